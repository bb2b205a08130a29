"""memory="low" on a fast pipeline: the pipeline places its components itself, the text encoder and the transformer's
block weights taking turns in one GPU buffer (core/runtime/offload.py's TakingTurns). Each family places them (the
2512 family: core/runtime/memory.py; Qwen-Image-2.1: qwen_image21/memory.py) and brings the blocks in before its
forwards; encoding brings the text encoder in here.
"""

import torch

from ..runtime.offload import TakingTurns


class TurnTakingPipeline:
    """Mixed in before the diffusers class; `_turns` is set by the family's _set_up with memory="low"."""

    _turns: TakingTurns | None = None

    @property
    def text_encoder_takes_turns(self) -> bool:
        """memory="low": encoding brings the text encoder onto the GPU in place of the transformer's block weights
        (and the next denoising call brings those back), so encode every prompt of a batch first (the command
        line's encode-ahead passes the embeddings to the calls)."""
        return self._turns is not None

    def to(self, *args, **kwargs):
        """diffusers' DiffusionPipeline.to; refused with memory="low", which places the components itself."""
        if self._turns is not None:
            raise ValueError("pipe.to(...) with FastConfig(memory='low'): the pipeline places its components itself "
                             "(the text encoder and the transformer's block weights take turns on the GPU); build it "
                             "with device=... instead")
        return super().to(*args, **kwargs)

    def _get_qwen_prompt_embeds(self, *args, **kwargs):
        """diffusers' text encoding (both families' pipelines have it); with memory="low", the text encoder's turn
        on the GPU first, and no autograd graph: one would keep the turn's device weights (and the activations)
        alive after the turn ends, and a streamed layer's slot holds another layer's weights by then."""
        if self._turns is None:
            return super()._get_qwen_prompt_embeds(*args, **kwargs)
        self._turns.use("text_encoder")
        with torch.no_grad():
            return super()._get_qwen_prompt_embeds(*args, **kwargs)

    def load_lora_weights(self, *args, **kwargs):
        """diffusers' load_lora_weights; with memory="low", during the block weights' turn on the GPU (the factors
        go where the linears they attach to are)."""
        if self._turns is not None:
            self._turns.use("transformer")
        return super().load_lora_weights(*args, **kwargs)
