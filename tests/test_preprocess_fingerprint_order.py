"""A step's fingerprint does not depend on where in memory its parameters live."""
from preprocess.fingerprint import fingerprint


class Tag:
    """A key with the default repr, which names the object's address."""

    def __init__(self, name: str) -> None:
        self.name = name


def _mapping(b_first: bool) -> dict:
    # the same mapping; which key object sits at the lower address depends on allocation order
    if b_first:
        b = Tag("b")
        a = Tag("a")
    else:
        a = Tag("a")
        b = Tag("b")
    return {a: 1, b: 2} if id(a) < id(b) else {b: 2, a: 1}


def test_a_dict_keyed_by_objects_of_the_default_repr_has_one_fingerprint():
    pool = [Tag(str(n)) for n in range(64)]  # leaves holes for the next objects to fall into
    prints = set()
    for k in range(8):
        del pool[k::8][:1]
        prints.add(fingerprint(_mapping(k % 2 == 0)))
        prints.add(fingerprint(_mapping(k % 2 == 1)))
    assert len(prints) == 1


def test_such_dicts_of_different_contents_still_differ():
    a, b = Tag("a"), Tag("b")
    assert fingerprint({a: 1, b: 2}) != fingerprint({a: 2, b: 1})
    assert fingerprint({Tag("x"): 1, Tag("x"): 2}) != fingerprint({Tag("x"): 1, Tag("x"): 3})
    assert fingerprint({Tag("x"): 1, Tag("x"): 2}) == fingerprint({Tag("x"): 2, Tag("x"): 1})


def test_a_dict_of_plain_keys_keeps_its_order_of_keys():
    d = {"b": 1, "a": 2, 3: 4}
    assert fingerprint(d) == fingerprint(dict(reversed(list(d.items()))))
