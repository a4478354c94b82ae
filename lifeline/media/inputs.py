"""An image as the engine carries it: where its tokens sit in the prompt, its pixel values,
and its hash (torch-free: the scheduler and the KV manager read it).

A prompt with images is made as Hugging Face's processors make it: each image's marker in the
rendered text (Idefics3's `<image>`, Gemma 3's `<start_of_image>`) is replaced by the
family's placeholder text, the whole text is tokenized, and image i takes the next
`frames × tokens per frame` positions that hold the image token (`locate`). For prompts given
as token ids, `splice_ids` replaces each marker id by the placeholder's ids.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True, eq=False)
class ImageSpan:
    hash: str
    """The image's pixel hash (lifeline.media.images.pixel_hash)."""
    positions: tuple[int, ...]
    """The prompt positions its embedding rows go to, in order (the image tokens)."""
    pixels: Any = None
    """The processed frames (numpy [frames, 3, side, side]) until the vision tower has
    encoded them: then dropped (`encoded`), which frees them (and their charge on the
    server's image budget)."""
    frames: int = 1
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds spent before the engine: fetch, decode, preprocess."""
    embeds: Any = None
    """The tower's rows of this image once encoded (a tensor where the model runs), kept
    while a request holds the span: a later chunk after an encoder-cache eviction, a
    preempted request's recomputation or the other choices of `n` need no frames. A few
    times smaller than the frames; freed with the request."""
    encoder: Any = None
    """The encoder cache of the engine whose tower made `embeds` (another engine's model
    gives other rows)."""

    def encoded(self, embeds: Any, encoder: Any) -> None:
        """The tower has run: keep its rows, drop the frames."""
        self.embeds, self.encoder, self.pixels = embeds, encoder, None

    @property
    def offset(self) -> int:
        return self.positions[0]

    @property
    def end(self) -> int:
        """One past its last image token."""
        return self.positions[-1] + 1

    @property
    def num_embeds(self) -> int:
        return len(self.positions)


def locate(token_ids: Sequence[int], image_token_id: int, counts: Sequence[int]
           ) -> list[tuple[int, ...]]:
    """Positions of each image's tokens: image i takes the next `counts[i]` image tokens."""
    where = [i for i, t in enumerate(token_ids) if t == image_token_id]
    if len(where) != sum(counts):
        raise ValueError(f"the prompt has {len(where)} image tokens; its images need "
                         f"{sum(counts)}")
    out, at = [], 0
    for n in counts:
        out.append(tuple(where[at:at + n]))
        at += n
    return out


def splice_ids(token_ids: Sequence[int], marker_id: int,
               placeholders: Sequence[Sequence[int]]) -> list[int]:
    """Each occurrence of `marker_id`, in order, replaced by the next placeholder's ids."""
    count = sum(1 for t in token_ids if t == marker_id)
    if count != len(placeholders):
        raise ValueError(f"the prompt marks {count} images; {len(placeholders)} were given")
    out: list[int] = []
    it = iter(placeholders)
    for t in token_ids:
        out.extend(next(it) if t == marker_id else (t,))
    return out


def encode_placeholder(text: str, specials: dict[str, int],
                       encode: Callable[[str], list[int]]) -> list[int]:
    """Ids of placeholder text: its special tokens by id, the text between them encoded
    alone (a tokenizer splits on special tokens first, so this is what the whole text's
    tokenization gives for these pieces)."""
    ids: list[int] = []
    rest = text
    names = sorted(specials, key=len, reverse=True)
    while rest:
        hit = min(((rest.find(n), n) for n in names if n in rest), default=None)
        if hit is None:
            ids.extend(encode(rest))
            break
        at, name = hit
        if at:
            ids.extend(encode(rest[:at]))
        ids.append(specials[name])
        rest = rest[at + len(name):]
    return ids


def image_block_keys(images: Sequence[ImageSpan], block_size: int, first_block: int,
                     count: int) -> list[bytes]:
    """Per block first_block .. first_block + count - 1: the hashes of the images whose
    tokens it holds, joined (b"" for a block of text), so that blocks of different images
    never share a prefix-cache digest."""
    keys = [b""] * count
    for img in images:
        lo = img.offset // block_size
        hi = (img.end - 1) // block_size
        for b in range(max(lo, first_block), min(hi, first_block + count - 1) + 1):
            keys[b - first_block] += bytes.fromhex(img.hash)
    return keys
