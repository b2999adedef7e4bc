"""The tiny tasks' data sources: finite, indexable sets of examples.

A *source* has ``len(source)`` and ``source.get(indices)``, which prepares only the requested rows
and returns a dict of numpy arrays; every example is a pure function of its index (and the
source's seed), so any process can build any rows. The trainer's input pipeline
(:mod:`podscale.train.data`) picks which rows form each step's global batch.
"""

from __future__ import annotations

import functools

import numpy as np

_DIGITS_HELD_OUT = 360  # of 1797 images; fixed split, permutation seed 0


def hash_uniform(seed: int, index: np.ndarray, stream: int) -> np.ndarray:
    """Uniform [0, 1) floats, a pure function of (seed, index, stream) (splitmix64)."""
    with np.errstate(over="ignore"):
        z = (index.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ np.uint64(seed * 1_000_003 + stream)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)


@functools.cache
def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits  # ships inside scikit-learn: nothing is downloaded

    d = load_digits()
    return d.images, d.target


class Digits:
    """scikit-learn's 8x8 handwritten digits: 1437 train / 360 held-out images, fixed split.

    Examples: ``image`` float32 [8, 8] scaled to [0, 1], ``label`` int32.
    """

    num_classes = 10

    def __init__(self, split: str = "train"):
        if split not in ("train", "test"):
            raise ValueError(f"Digits split {split!r}: use 'train' or 'test'")
        images, labels = _digits()
        order = np.random.default_rng(0).permutation(len(labels))
        rows = order[_DIGITS_HELD_OUT:] if split == "train" else order[:_DIGITS_HELD_OUT]
        self._images, self._labels = images, labels
        self._rows = rows
        self.split = split

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        rows = self._rows[indices]
        return {"image": (self._images[rows] / 16.0).astype(np.float32), "label": self._labels[rows].astype(np.int32)}


class DigitDetection:
    """A real-glyph detection set: scikit-learn's handwritten digits pasted at random scales and
    non-overlapping positions on blank canvases, with exact boxes (the glyph's inked pixels).

    The train canvases take glyphs from :class:`Digits`' train split, the held-out ones from its
    test split, so no glyph is seen in both. Every canvas is a pure function of (split, index):
    ``size`` canvases of ``canvas x canvas`` pixels with 1 to ``max_objects`` digits of
    ``min_size`` to ``max_size`` pixels each (nearest-neighbour scaled). Examples: ``image``
    float32 ``[canvas, canvas]`` in [0, 1]; ``boxes`` float32 ``[max_objects, 4]`` ltrb in [0, 1]
    (rows past the canvas's objects are zero); ``labels`` int32 ``[max_objects]``: the digit + 1,
    0 for no object. With ``encoder`` (``(boxes, labels) -> dict``), its arrays are added, e.g.
    the SSD targets of every default box. With ``mask_size``, each object's instance mask too
    (its glyph's inked pixels): ``masks`` float32 ``[max_objects, mask_size, mask_size]``, the mask
    cropped at the object's box and sampled (nearest) to that size (zeros past the objects), and
    ``index`` int32, the canvas's index; :meth:`instance_masks` gives the whole-canvas masks.
    """

    num_classes = 10

    def __init__(
        self,
        split: str = "train",
        size: int | None = None,
        canvas: int = 64,
        max_objects: int = 3,
        min_size: int = 14,
        max_size: int = 30,
        encoder=None,
        mask_size: int | None = None,
    ):
        if split not in ("train", "test"):
            raise ValueError(f"DigitDetection split {split!r}: use 'train' or 'test'")
        if not 8 <= min_size <= max_size <= canvas:
            raise ValueError(
                f"DigitDetection: need 8 <= min_size <= max_size <= canvas, got {min_size}, {max_size}, {canvas}"
            )
        self.split, self.canvas, self.max_objects = split, canvas, max_objects
        self.min_size, self.max_size, self.encoder = min_size, max_size, encoder
        if mask_size is not None and mask_size < 1:
            raise ValueError(f"DigitDetection: mask_size must be at least 1, got {mask_size}")
        self.mask_size = mask_size
        self.size = size if size is not None else (4096 if split == "train" else 512)
        self._glyphs = Digits(split)

    def __len__(self) -> int:
        return self.size

    def example(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self._example(index)[:3]

    def instance_masks(self, index: int) -> np.ndarray:
        """``[objects, canvas, canvas]`` bool: each object's inked pixels on the whole canvas."""
        return self._example(index)[3]

    def _example(self, index: int):
        rng = np.random.default_rng([0 if self.split == "train" else 1, int(index)])
        image = np.zeros((self.canvas, self.canvas), np.float32)
        taken = np.zeros_like(image, dtype=bool)
        boxes = np.zeros((self.max_objects, 4), np.float32)
        labels = np.zeros(self.max_objects, np.int32)
        masks = []
        count = int(rng.integers(1, self.max_objects + 1))
        placed = 0
        for _ in range(50 * count):  # rejection sampling of free squares
            if placed == count:
                break
            s = int(rng.integers(self.min_size, self.max_size + 1))
            y, x = (int(v) for v in rng.integers(0, self.canvas - s + 1, size=2))
            if taken[y : y + s, x : x + s].any():
                continue
            glyph = self._glyphs.get(np.array([int(rng.integers(len(self._glyphs)))]))
            pixels = glyph["image"][0][np.ix_(*(np.arange(s) * 8 // s,) * 2)]
            image[y : y + s, x : x + s] = pixels
            taken[y : y + s, x : x + s] = True
            rows, cols = np.nonzero(pixels > 0)
            boxes[placed] = (
                np.array([x + cols.min(), y + rows.min(), x + cols.max() + 1, y + rows.max() + 1]) / self.canvas
            )
            labels[placed] = int(glyph["label"][0]) + 1
            mask = np.zeros(image.shape, bool)
            mask[y : y + s, x : x + s] = pixels > 0
            masks.append(mask)
            placed += 1
        return image, boxes, labels, np.asarray(masks, bool).reshape(-1, self.canvas, self.canvas)

    def _crops(self, boxes: np.ndarray, masks: np.ndarray) -> np.ndarray:
        size = self.mask_size
        out = np.zeros((self.max_objects, size, size), np.float32)
        for i, (box, mask) in enumerate(zip(boxes, masks, strict=False)):
            x0, y0, x1, y1 = np.rint(box * self.canvas).astype(int)
            rows = y0 + ((np.arange(size) + 0.5) * (y1 - y0) / size).astype(int)
            cols = x0 + ((np.arange(size) + 0.5) * (x1 - x0) / size).astype(int)
            out[i] = mask[np.ix_(rows, cols)]
        return out

    def get(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        examples = [self._example(int(i)) for i in np.asarray(indices)]
        out = {
            "image": np.stack([e[0] for e in examples]),
            "boxes": np.stack([e[1] for e in examples]),
            "labels": np.stack([e[2] for e in examples]),
        }
        if self.mask_size is not None:
            out["masks"] = np.stack([self._crops(e[1], e[3]) for e in examples])
            out["index"] = np.asarray(indices, np.int32).reshape(-1)
        if self.encoder is not None:
            encoded = [self.encoder(b[lab > 0], lab[lab > 0]) for _, b, lab, _ in examples]
            for key in encoded[0]:
                out[key] = np.stack([e[key] for e in encoded])
        return out


class SyntheticImages:
    """Images of Gaussian-like noise labelled by a fixed random linear teacher (learnable).

    Every example is a pure function of (seed, index); nothing is held in memory.
    """

    def __init__(self, size: int = 4096, shape: tuple[int, ...] = (8, 8), num_classes: int = 10, seed: int = 0):
        self.size, self.shape, self.num_classes, self.seed = size, tuple(shape), num_classes, seed
        dim = int(np.prod(shape))
        self._teacher = np.random.default_rng([seed, 7]).normal(size=(dim, num_classes)).astype(np.float32)

    def __len__(self) -> int:
        return self.size

    def get(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        dim = int(np.prod(self.shape))
        flat = indices[:, None].astype(np.uint64) * np.uint64(dim) + np.arange(dim, dtype=np.uint64)[None, :]
        x = (hash_uniform(self.seed, flat, stream=1) * 2.0 - 1.0).astype(np.float32)
        label = np.argmax(x @ self._teacher, axis=-1).astype(np.int32)
        return {"image": x.reshape(len(indices), *self.shape), "label": label}


class SyntheticTokens:
    """Token sequences ``(a + b * t) mod vocab``, with (a, b) a pure function of (seed, index).

    A language model learns to read the stride from the first tokens and continue it.
    """

    def __init__(self, size: int = 4096, seq_len: int = 32, vocab_size: int = 32, seed: int = 0):
        self.size, self.seq_len, self.vocab_size, self.seed = size, seq_len, vocab_size, seed

    def __len__(self) -> int:
        return self.size

    def get(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        start = (hash_uniform(self.seed, indices, stream=2) * self.vocab_size).astype(np.int64)
        stride = 1 + (hash_uniform(self.seed, indices, stream=3) * (self.vocab_size // 4)).astype(np.int64)
        t = np.arange(self.seq_len + 1)
        seq = (start[:, None] + stride[:, None] * t[None, :]) % self.vocab_size
        return {"tokens": seq[:, :-1].astype(np.int32), "targets": seq[:, 1:].astype(np.int32)}
