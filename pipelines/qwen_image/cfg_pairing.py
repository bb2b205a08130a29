"""Classifier-free guidance batched across the two forwards a diffusers Qwen-Image pipeline makes per step.

Diffusers' image-conditioned Qwen-Image pipelines call the transformer twice per step, under cache_context("cond")
and then cache_context("uncond"), with the same latents, timestep and image shapes and two texts, the negative one
the same tensor for the whole call. One forward of batch 2B runs such a step faster than two of batch B (RESULTS.md,
"Editing and image-conditioned generation"), and this gets it without rewriting their loops:

- a "cond" forward also computes, in the same batch, the "uncond" forward with the negative text the previous
  step's "uncond" call passed (padded to a common length and masked, as the text-to-image pipeline's batched CFG
  does), and keeps that half;
- the step's "uncond" call returns the kept half only if its inputs are those it was computed from: the same
  latents and text tensors, unmodified since (their version counters), an equal timestep (one host sync), the same
  image shapes, LoRA scale and adapters; otherwise it runs as usual and the kept half is dropped.

So the first step runs unpaired (no negative text seen yet), and a loop that calls otherwise gets what it asked
for. Calls with ControlNet residuals (computed per text), `additional_t_cond` or `guidance` are never paired.
"""

from dataclasses import dataclass

import torch


def pad_text(embeds: torch.Tensor, mask: torch.Tensor | None, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """embeds [N, L, D] and mask [N, L] (None: all valid) -> zero-padded to `length`, with the padding masked."""
    n, seq, _ = embeds.shape
    if mask is None:
        mask = torch.ones(n, seq, dtype=torch.long, device=embeds.device)
    pad = length - seq
    return torch.nn.functional.pad(embeds, (0, 0, 0, pad)), torch.nn.functional.pad(mask, (0, pad))


def version(t: torch.Tensor | None) -> int | None:
    return None if t is None else t._version


@dataclass
class NegativeText:
    """The text of the last "uncond" call, and the version counters it had then."""

    embeds: torch.Tensor
    mask: torch.Tensor | None
    versions: tuple

    @classmethod
    def of(cls, embeds, mask) -> "NegativeText":
        return cls(embeds, mask, (version(embeds), version(mask)))

    def unchanged(self) -> bool:
        return (version(self.embeds), version(self.mask)) == self.versions


@dataclass
class Speculated:
    """The "uncond" half of a paired forward and the inputs it was computed from."""

    hidden_states: torch.Tensor
    hidden_version: int
    timestep: torch.Tensor
    img_shapes: str
    state: tuple  # (LoRA call scale, adapters' version)
    negative: NegativeText
    output: torch.Tensor


class CfgPairing:
    """Held by a FastQwenImageTransformer during one call of a pipeline that batches CFG (a new one per call);
    called by its forward instead of `_forward`. `paired`: how many paired forwards ran."""

    def __init__(self):
        self.negative: NegativeText | None = None
        self.speculated: Speculated | None = None
        self.paired = 0

    def __call__(self, forward, context: str | None, inputs: dict, state: tuple) -> torch.Tensor:
        """forward(**inputs) -> [B, L_img, C], or its half of a paired forward. state: what else decides the
        output (LoRA scale and adapters' version)."""
        speculated, self.speculated = self.speculated, None
        if any(inputs[name] is not None for name in ("controlnet_block_samples", "additional_t_cond", "guidance")):
            self.negative = None
            return forward(**inputs)
        if context == "uncond":
            if speculated is not None and self._is_what_was_speculated(speculated, inputs, state):
                return speculated.output
            self.negative = NegativeText.of(inputs["encoder_hidden_states"], inputs["encoder_hidden_states_mask"])
            return forward(**inputs)
        negative = self.negative
        if context != "cond" or negative is None or not self._pairs_with(negative, inputs):
            return forward(**inputs)
        out = self._paired_forward(forward, inputs, negative)
        batch = inputs["hidden_states"].shape[0]
        hidden = inputs["hidden_states"]
        self.speculated = Speculated(hidden, hidden._version, inputs["timestep"], repr(inputs["img_shapes"]), state,
                                     negative, out[batch:])
        self.paired += 1
        return out[:batch]

    @staticmethod
    def _pairs_with(negative: NegativeText, inputs: dict) -> bool:
        text = inputs["encoder_hidden_states"]
        return (negative.unchanged() and negative.embeds.shape[0] == text.shape[0]
                and negative.embeds.dtype == text.dtype and negative.embeds.device == text.device)

    @staticmethod
    def _is_what_was_speculated(speculated: Speculated, inputs: dict, state: tuple) -> bool:
        negative, hidden = speculated.negative, inputs["hidden_states"]
        return (hidden is speculated.hidden_states and hidden._version == speculated.hidden_version
                and inputs["encoder_hidden_states"] is negative.embeds
                and inputs["encoder_hidden_states_mask"] is negative.mask and negative.unchanged()
                and repr(inputs["img_shapes"]) == speculated.img_shapes and state == speculated.state
                and inputs["timestep"].shape == speculated.timestep.shape
                and bool(torch.equal(inputs["timestep"], speculated.timestep)))

    @staticmethod
    def _paired_forward(forward, inputs: dict, negative: NegativeText) -> torch.Tensor:
        """One forward of batch 2B: [cond; uncond], the shorter text zero-padded and masked."""
        text, mask = inputs["encoder_hidden_states"], inputs["encoder_hidden_states_mask"]
        length = max(text.shape[1], negative.embeds.shape[1])
        if mask is None and negative.mask is None and text.shape[1] == negative.embeds.shape[1]:
            paired_text, paired_mask = torch.cat([text, negative.embeds]), None
        else:
            (text, mask), (neg, neg_mask) = pad_text(text, mask, length), pad_text(negative.embeds, negative.mask,
                                                                                    length)
            paired_text, paired_mask = torch.cat([text, neg]), torch.cat([mask.to(neg_mask.dtype), neg_mask])
        hidden, timestep = inputs["hidden_states"], inputs["timestep"]
        return forward(**inputs | dict(hidden_states=torch.cat([hidden, hidden]), encoder_hidden_states=paired_text,
                                       encoder_hidden_states_mask=paired_mask, timestep=torch.cat([timestep, timestep]),
                                       img_shapes=list(inputs["img_shapes"]) * 2))
