"""ResNet-style image steps on numpy arrays (PIL for JPEG decoding and resizing),
for examples and benchmarks: no torchvision needed. Arrays are HxWxC; the random
steps draw from numpy's global generator, which the pipeline seeds per item."""
from __future__ import annotations

import io

import numpy as np

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def decode_jpeg(data: bytes) -> np.ndarray:
    from PIL import Image
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"))


class RandomCrop:
    """A random crop of `scale` of the area and aspect ratio within `ratio`
    (RandomResizedCrop without the resize); the box depends only on the shape."""
    random = True

    def __init__(self, scale: tuple[float, float] = (0.25, 1.0), ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> None:
        # torchvision's RandomCrop(224) takes a size: refused here, not at the first item deep in a worker
        for name, pair in (("scale", scale), ("ratio", ratio)):
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2
                    and all(isinstance(v, (int, float)) and v > 0 for v in pair) and pair[0] <= pair[1]):
                raise ValueError(f"RandomCrop({name}={pair!r}): {name} is a (low, high) pair of positive numbers, "
                                 "low <= high (scale: fractions of the area, e.g. (0.25, 1.0); ratio: aspect "
                                 "ratios); it takes no size: for one, follow RandomCrop() with Resize(size)")
        self.scale, self.ratio = scale, ratio

    def __call__(self, x: np.ndarray) -> np.ndarray:
        h, w = x.shape[:2]
        area = np.random.uniform(*self.scale) * h * w
        r = np.exp(np.random.uniform(np.log(self.ratio[0]), np.log(self.ratio[1])))
        ch, cw = min(h, max(1, int(round(np.sqrt(area / r))))), min(w, max(1, int(round(np.sqrt(area * r)))))
        top, left = np.random.randint(0, h - ch + 1), np.random.randint(0, w - cw + 1)
        return np.ascontiguousarray(x[top:top + ch, left:left + cw])


class Resize:
    """Bilinear resize to size x size (uint8 as RGB, floats channel by channel)."""

    def __init__(self, size: int = 224) -> None:
        self.size = size

    def __call__(self, x: np.ndarray) -> np.ndarray:
        from PIL import Image
        s = (self.size, self.size)
        if x.dtype == np.uint8:
            return np.asarray(Image.fromarray(x).resize(s, Image.BILINEAR))
        chans = [np.asarray(Image.fromarray(np.ascontiguousarray(x[..., c], dtype=np.float32), "F")
                            .resize(s, Image.BILINEAR)) for c in range(x.shape[2])]
        return np.stack(chans, axis=2).astype(x.dtype)


class RandomFlip:
    """Horizontal flip with probability p."""
    random = True

    def __init__(self, p: float = 0.5) -> None:
        self.p = p

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x[:, ::-1]) if np.random.random() < self.p else x


def to_float(x: np.ndarray) -> np.ndarray:
    """uint8 [0, 255] -> float32 [0, 1]."""
    return x.astype(np.float32) * np.float32(1 / 255)


class Normalize:
    """(x - mean) / std per channel, in x's float type."""

    def __init__(self, mean: tuple = IMAGENET_MEAN, std: tuple = IMAGENET_STD) -> None:
        self.mean, self.std = np.asarray(mean, np.float32), np.asarray(std, np.float32)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        dt = x.dtype if x.dtype.kind == "f" else np.float32
        return ((x - self.mean.astype(dt)) / self.std.astype(dt)).astype(dt)


class Cast:
    def __init__(self, dtype: str = "float16") -> None:
        self.dtype = dtype

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return x.astype(self.dtype)


def resnet_steps(size: int = 224) -> list:
    """The usual order: decode, crop, resize, flip, to float, normalize, cast."""
    return [decode_jpeg, RandomCrop(), Resize(size), RandomFlip(), to_float, Normalize(), Cast()]


def resnet_steps_inflating_first(size: int = 224) -> list:
    """The same steps with the inflating to_float written before the deflating crop and resize."""
    return [decode_jpeg, to_float, RandomCrop(), Resize(size), RandomFlip(), Normalize(), Cast()]
