"""From decoded images to what the engine takes: each image processed by its family's
processor (timed), its placeholder put where the prompt marks it, and its `ImageSpan`
(positions, pixels, hash) found in the tokenized prompt."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lifeline.media.images import DecodedImage
from lifeline.media.inputs import ImageSpan, encode_placeholder, locate, splice_ids
from lifeline.media.processors import Gemma3Processor, Idefics3Processor, ProcessedImage
from lifeline.model.config import VisionSpec


@dataclass(frozen=True, slots=True)
class PreparedImage:
    """An image ready for the prompt. It keeps no decoded picture: that is freed once
    preprocessed."""
    hash: str
    """The decoded picture's pixel hash (lifeline.media.images.pixel_hash)."""
    processed: ProcessedImage | None
    """The frames; None once handed over to the engine's `ImageSpan` (`without_frames`)."""
    placeholder: str
    timings: dict[str, float]

    def without_frames(self) -> PreparedImage:
        """This image once its spans carry its frames: what the prompt still needs of it."""
        return dataclasses.replace(self, processed=None)


class ImagePreparer:
    """One model's image path: `prepare` each image, `expand_text` the rendered prompt (or
    `expand_ids` a prompt of token ids), tokenize, then `spans`."""

    def __init__(self, spec: VisionSpec):
        self.spec = spec
        side = spec.vision.get("image_size", 224)
        if spec.family == "idefics3":
            config = {"max_image_size": {"longest_edge": side}, **spec.processor}
            self.processor: Idefics3Processor | Gemma3Processor = Idefics3Processor.from_config(
                config, image_seq_len=spec.tokens_per_image)
        else:
            config = {"size": {"height": side, "width": side}, **spec.processor}
            self.processor = Gemma3Processor.from_config(config,
                                                         image_seq_len=spec.tokens_per_image)
        if spec.family == "idefics3" and self.processor.side != side:
            raise ValueError(f"the processor's tiles are {self.processor.side} px; the "
                             f"encoder's side is {side}")

    def prepare(self, decoded: DecodedImage, timings: dict[str, float] | None = None
                ) -> PreparedImage:
        t0 = time.perf_counter()
        processed = self.processor(decoded.image)
        timings = {**(timings or {}), "preprocess_s": time.perf_counter() - t0}
        if isinstance(self.processor, Idefics3Processor):
            text = self.processor.placeholder(processed.rows, processed.cols)
        else:
            text = self.processor.placeholder(processed.crops)
        return PreparedImage(decoded.hash, processed, text, timings)

    def expand_text(self, text: str, images: Sequence[PreparedImage]) -> str:
        """Each marker in `text`, in order, replaced by its image's placeholder."""
        parts = text.split(self.spec.marker)
        if len(parts) - 1 != len(images):
            raise ValueError(f"the prompt marks {len(parts) - 1} images; {len(images)} "
                             "were given")
        out = [parts[0]]
        for img, rest in zip(images, parts[1:]):
            out.append(img.placeholder)
            out.append(rest)
        return "".join(out)

    def expand_ids(self, token_ids: Sequence[int], images: Sequence[PreparedImage],
                   specials: dict[str, int], encode: Callable[[str], list[int]]) -> list[int]:
        """A prompt of ids with one marker id per image: each marker replaced by its image's
        placeholder ids."""
        marker = specials[self.spec.marker]
        return splice_ids(token_ids, marker, [encode_placeholder(i.placeholder, specials, encode)
                                              for i in images])

    def spans(self, token_ids: Sequence[int], images: Sequence[PreparedImage]
              ) -> list[ImageSpan]:
        counts = [i.processed.frames * self.spec.tokens_per_image for i in images]
        where = locate(token_ids, self.spec.image_token_id, counts)
        return [ImageSpan(i.hash, pos, i.processed.pixel_values, i.processed.frames,
                          dict(i.timings)) for i, pos in zip(images, where)]
