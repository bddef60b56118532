import pytest

from cacheserver.sizes import format_size, parse_size


@pytest.mark.parametrize("text,value", [
    ("200GB", 200 * 10**9), ("1GiB", 2**30), ("512MiB", 512 * 2**20), ("64MB", 64 * 10**6),
    ("1048576", 1048576), ("1.5KB", 1500), ("110KiB", 110 * 1024), ("2G", 2 * 2**30), (" 3 mb ", 3 * 10**6),
])
def test_parse(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["", "GB", "12XB", "-1GB", "1e3", "ten"])
def test_parse_rejects_with_named_input(bad):
    with pytest.raises(ValueError, match="not a size"):
        parse_size(bad)


def test_format():
    assert format_size(512) == "512 B"
    assert format_size(3 * 2**30) == "3.0 GiB"
