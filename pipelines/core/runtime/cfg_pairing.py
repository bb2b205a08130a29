"""Classifier-free guidance batched: the prompt's and the negative prompt's forwards as one forward of batch 2B.

`paired_inputs` builds that forward's inputs from the prompt's forward and the negative text: the same latents,
timestep and image shapes twice, the two texts zero-padded to one length and the padding masked (never attended).
The runner (runner.py) runs it for both kinds of loop:
- the text-to-image pipeline's own loop asks for the pair explicitly;
- diffusers' image-conditioned pipelines call the transformer twice per step, under cache_context("cond") and then
  cache_context("uncond"), with the same latents, timestep and image shapes and two texts (the negative one the
  same tensor for the whole call). Speculation gets them paired without rewriting their loops: a "cond" forward
  also computes the "uncond" half with the negative text the previous step's "uncond" call passed, and keeps it;
  the step's "uncond" call returns the kept half only if its inputs are those it was computed from (the same
  latents and text tensors, unmodified since (their version counters), the same image shapes, LoRA scale and
  adapters, a timestep of the same shape); otherwise it runs as usual and the kept half is dropped. The timesteps'
  values are compared on the device and read at the end of the call (Speculation.verify: a ValueError then, the
  result not returned), not at each step, where the read would stall the GPU. So the first
  step runs unpaired, and a loop that calls otherwise gets what it asked for. Calls with ControlNet residuals
  (computed per text), `additional_t_cond` or `guidance` are never paired there. Qwen-Image-2.1's model pairs its
  cached steps the same way (its branch's own inputs: the text, its image slots and its prefix cache;
  qwen_image21/model.py).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def pad_text(embeds: torch.Tensor, mask: torch.Tensor | None, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """embeds [N, L, D] and mask [N, L] (None: all valid) -> zero-padded to `length`, with the padding masked."""
    n, seq, _ = embeds.shape
    if mask is None:
        mask = torch.ones(n, seq, dtype=torch.long, device=embeds.device)
    pad = length - seq
    return F.pad(embeds, (0, 0, 0, pad)), F.pad(mask, (0, pad))


def bucketed_text(inputs: dict, bucket: int) -> dict:
    """The text of a forward's inputs padded (masked) to a multiple of `bucket` tokens, so that prompts of other
    lengths share a CUDA graph."""
    text, mask = inputs["encoder_hidden_states"], inputs["encoder_hidden_states_mask"]
    length = math.ceil(text.shape[1] / bucket) * bucket
    if length == text.shape[1]:
        return inputs
    text, mask = pad_text(text, mask, length)
    return inputs | dict(encoder_hidden_states=text, encoder_hidden_states_mask=mask)


def paired_inputs(inputs: dict, negative_embeds: torch.Tensor, negative_mask: torch.Tensor | None,
                  modulation: torch.Tensor | None = None) -> dict:
    """One forward of batch 2B, [prompt; negative prompt], from the prompt's forward `inputs` (batch B) and the
    negative text [B, L', D] (mask [B, L'] or None): the shorter text zero-padded and masked. modulation: the
    pair's row of a modulation table (batch 2B), or None."""
    text, mask = inputs["encoder_hidden_states"], inputs["encoder_hidden_states_mask"]
    if mask is None and negative_mask is None and text.shape[1] == negative_embeds.shape[1]:
        paired_text, paired_mask = torch.cat([text, negative_embeds]), None
    else:
        length = max(text.shape[1], negative_embeds.shape[1])
        (text, mask), (neg, neg_mask) = pad_text(text, mask, length), pad_text(negative_embeds, negative_mask, length)
        paired_text, paired_mask = torch.cat([text, neg]), torch.cat([mask.to(neg_mask.dtype), neg_mask])
    hidden, timestep, guidance = inputs["hidden_states"], inputs["timestep"], inputs["guidance"]
    return inputs | dict(hidden_states=torch.cat([hidden, hidden]), encoder_hidden_states=paired_text,
                         encoder_hidden_states_mask=paired_mask, timestep=torch.cat([timestep, timestep]),
                         img_shapes=list(inputs["img_shapes"]) * 2,
                         guidance=None if guidance is None else torch.cat([guidance, guidance]), modulation=modulation)


def version(t) -> int | None:
    return t._version if isinstance(t, torch.Tensor) else None


@dataclass
class NegativeInputs:
    """What the last "uncond" call passed for its own branch (the negative text; a model's other per-branch inputs:
    Speculation.branch_inputs), and the version counters its tensors had then."""

    inputs: dict
    versions: tuple

    @classmethod
    def of(cls, inputs: dict, names: tuple) -> "NegativeInputs":
        kept = {name: inputs[name] for name in names}
        return cls(kept, tuple(version(v) for v in kept.values()))

    def unchanged(self) -> bool:
        return tuple(version(v) for v in self.inputs.values()) == self.versions


@dataclass
class Speculated:
    """The "uncond" half of a paired forward and the inputs it was computed from."""

    hidden_states: torch.Tensor
    hidden_version: int
    timestep: torch.Tensor
    img_shapes: str
    state: tuple  # (LoRA call scale, adapters' version)
    negative: NegativeInputs
    output: torch.Tensor


class Speculation:
    """The pairing of one diffusers-loop call (a new one per call). __call__ answers one forward: `forward(inputs)`
    runs one, `pair(inputs, negative)` runs a pair (negative: the "uncond" call's branch_inputs, by name) and
    returns both halves. branch_inputs: the forward's arguments that are the branch's own (the 2512 models': the
    text and its mask; Qwen-Image-2.1's also its image slots and prefix cache); pairable(inputs): whether a forward
    takes part in pairing at all (the 2512 models': no ControlNet residuals, additional_t_cond or guidance);
    pairs_now(inputs): whether a "cond" forward that does is paired (Qwen-Image-2.1's: its cached steps, not the
    prefill, whose "uncond" call still gives the next step its negative inputs)."""

    def __init__(self, branch_inputs: tuple = ("encoder_hidden_states", "encoder_hidden_states_mask"),
                 pairable=None, pairs_now=None):
        self.branch_inputs = branch_inputs
        self.pairable = pairable or (lambda inputs: all(
            inputs[name] is None for name in ("controlnet_block_samples", "additional_t_cond", "guidance")))
        self.pairs_now = pairs_now or (lambda inputs: True)
        self.negative: NegativeInputs | None = None
        self.speculated: Speculated | None = None
        self.timestep_checks: list[torch.Tensor] = []  # per kept half returned: its timesteps differ (device bool)

    def __call__(self, forward, pair, context: str | None, inputs: dict, state: tuple) -> torch.Tensor:
        speculated, self.speculated = self.speculated, None
        if not self.pairable(inputs):
            self.negative = None
            return forward(inputs)
        if context == "uncond":
            if speculated is not None and self._is_what_was_speculated(speculated, inputs, state):
                # the timesteps' values are compared on the device, read once at the end of the call (verify): a
                # host read here would stall the GPU at every step, which the CPU no longer runs ahead of
                self.timestep_checks.append((inputs["timestep"] != speculated.timestep).any())
                return speculated.output
            self.negative = NegativeInputs.of(inputs, self.branch_inputs)
            return forward(inputs)
        negative = self.negative
        if (context != "cond" or negative is None or not self.pairs_now(inputs)
                or not self._pairs_with(negative, inputs)):
            return forward(inputs)
        if inputs.get("modulation") is not None:
            raise ValueError("modulation= is for one forward; a pipeline that pairs CFG forwards computes it")
        cond, uncond = pair(inputs, negative.inputs)
        hidden = inputs["hidden_states"]
        self.speculated = Speculated(hidden, hidden._version, inputs["timestep"], repr(inputs["img_shapes"]), state,
                                     negative, uncond)
        return cond

    @staticmethod
    def _pairs_with(negative: NegativeInputs, inputs: dict) -> bool:
        text, negative_text = inputs["encoder_hidden_states"], negative.inputs["encoder_hidden_states"]
        return (negative.unchanged() and negative_text.shape[0] == text.shape[0]
                and negative_text.dtype == text.dtype and negative_text.device == text.device)

    def _is_what_was_speculated(self, speculated: Speculated, inputs: dict, state: tuple) -> bool:
        negative, hidden = speculated.negative, inputs["hidden_states"]
        return (hidden is speculated.hidden_states and hidden._version == speculated.hidden_version
                and all(inputs[name] is negative.inputs[name] for name in self.branch_inputs)
                and negative.unchanged()
                and repr(inputs["img_shapes"]) == speculated.img_shapes and state == speculated.state
                and inputs["timestep"].shape == speculated.timestep.shape
                and inputs["timestep"].device == speculated.timestep.device)

    def verify(self):
        """At the end of the call (the runner's): ValueError if a kept half was returned to an "uncond" call whose
        timestep's values were not its "cond" call's (a loop that diffusers' pipelines are not: each passes the
        step's timestep to both), so that its result is never returned."""
        if self.timestep_checks and bool(torch.stack(self.timestep_checks).any()):
            raise ValueError("batched CFG (FastConfig(batched_cfg=True)) answered an \"uncond\" forward with the half "
                             "its \"cond\" forward computed, and that \"uncond\" call passed another timestep: this "
                             "loop needs FastConfig(batched_cfg=False)")
