"""optimize() for Qwen-Image's other diffusers pipelines: their own __call__, unchanged, with the fast transformer.

The pipelines in ACCELERATED call `self.transformer(...)` as the text-to-image one does, with condition images'
latents joining the image stream (edit, layered: `img_shapes` lists them, Edit-2511 sets zero_cond_t), or ControlNet
residuals; the fast transformer gives what the stock one gives there (tests/pipelines/test_family.py, against each
stock pipeline). Batched CFG (FastConfig.batched_cfg) runs through the transformer, with their loops as diffusers
wrote them (pipelines/qwen_image/cfg_pairing.py); so do CUDA graphs (cuda_graph.CallGraphs) and the 2D VAE decode
(decoding_2d), each for one call. FastConfig's samplers and cfg_fraction change the text-to-image loop, which these
pipelines do not run: they are refused (replace pipe.scheduler instead). `applied` says what a call ran; the
measurements are in benchmarks/RESULTS.md, "Editing and image-conditioned generation".

Each has a fast class (FastQwenImageEditPlusPipeline, ...: the stock class with the fast transformer) whose
from_pretrained loads the stock checkpoint and converts it; from_pretrained() below picks the class from the
checkpoint's model_index.json, as diffusers' DiffusionPipeline.from_pretrained does.
"""

import contextlib
import inspect

import diffusers
import torch
from diffusers.models.autoencoders.vae import DecoderOutput
from diffusers.utils import logging
from transformers.utils import is_torchvision_available

from .config import FastConfig
from .pipeline import FastTransformerPipeline, fast_transformer
from .pipelines.qwen_image.cfg_pairing import CfgPairing
from .pipelines.qwen_image.cuda_graph import CallGraphs, GraphedForward
from .pipelines.qwen_image.transformer import FastQwenImageTransformer, has_offload_hooks
from .pipelines.qwen_image.vae import can_decode_image, decode_image

logger = logging.get_logger(__name__)

# Graphs a family pipeline keeps (a paired CFG forward, or a cond and an uncond one, per output and condition size).
MAX_GRAPHS = 4

ACCELERATED = ("QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline", "QwenImageEditPipeline",
               "QwenImageEditPlusPipeline", "QwenImageEditInpaintPipeline", "QwenImageLayeredPipeline",
               "QwenImageControlNetPipeline", "QwenImageControlNetInpaintPipeline")


class FastFamilyPipeline(FastTransformerPipeline):
    """Mixed in before one of ACCELERATED (fast_class): the fast transformer's answers, `fast_config`, `applied`."""

    fast_config: FastConfig

    @property
    def applied(self) -> list[str]:
        """After a call: what that call ran. Before the first: what is in force and runs when a call allows it
        (batched_cfg: CFG without ControlNet; cuda_graphs: a CUDA device and no offload hooks, from a forward
        signature's second forward in a call; vae_2d_decode: a stock VAE without tiling or hooks)."""
        if self._ran is not None:
            return list(self._ran)
        return (self._transformer_entries() + (["batched_cfg"] if self._batches_cfg() else [])
                + (["cuda_graphs"] if self._graphs_usable() else [])
                + (["vae_2d_decode"] if self.fast_config.vae_2d_decode else []))

    def _batches_cfg(self) -> bool:
        return self.fast_config.batched_cfg and self._fast_transformer() is not None

    def __call__(self, *args, **kwargs):
        """diffusers' __call__; for this call only, the transformer pairs its CFG forwards (batched_cfg), replays
        them from CUDA graphs (cuda_graphs) and the VAE decodes as 2D convolutions (vae_2d_decode), so a transformer
        or VAE shared with another pipeline does none of it for that one."""
        transformer = self._fast_transformer()
        pairing = CfgPairing() if self._batches_cfg() else None
        graphs = None
        if self._graphs_usable():
            self._graphs.drop_if_weights_moved()
            graphs = CallGraphs(self._graphs)
        decoded_2d = []
        if transformer is not None:
            transformer.cfg_pairing, transformer.call_graphs = pairing, graphs
        try:
            with decoding_2d(self.vae, decoded_2d) if self.fast_config.vae_2d_decode else contextlib.nullcontext():
                return super().__call__(*args, **kwargs)
        finally:
            if transformer is not None:
                transformer.cfg_pairing = transformer.call_graphs = None
            if graphs is not None and graphs.failed is not None:
                logger.warning("CUDA graph capture failed, running the transformer eagerly: %s",
                               graphs.failed.__cause__ or graphs.failed)
                self._graphs = None
            self._ran = (self._transformer_entries() + (["batched_cfg"] if pairing and pairing.paired else [])
                         + (["cuda_graphs"] if graphs and graphs.replayed else [])
                         + (["vae_2d_decode"] if decoded_2d else []))

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, fast_config=None, device=None, **kwargs):
        """The stock checkpoint (hub id or local folder), loaded by diffusers as the stock class (in BF16 unless
        dtype is given; see load_stock), its transformer converted on `device`."""
        from .pipeline import is_fast_checkpoint

        if is_fast_checkpoint(pretrained_model_name_or_path):
            raise ValueError(f"{pretrained_model_name_or_path} holds the text-to-image fast transformer: load it with "
                             "QwenImageFastPipeline, or build this pipeline from the stock checkpoint")
        pipe = load_stock(stock_class(cls), pretrained_model_name_or_path, *args, **kwargs)
        return optimize_family(pipe, FastConfig.coerce(fast_config), device, None)

    def save_pretrained(self, save_directory, *args, **kwargs):
        raise NotImplementedError(
            f"save_pretrained of an optimized {stock_class(type(self)).__name__} is not supported yet (its folder "
            "would name a class diffusers cannot load): save the stock pipeline, or save the text-to-image "
            "QwenImageFastPipeline, whose transformer folder this pipeline can be built from")


_FAST_CLASSES: dict[type, type] = {}


def stock_class(fast: type) -> type:
    """The diffusers class a fast_class() was made from."""
    return fast.__bases__[-1]


def fast_class(cls: type) -> type:
    """The fast counterpart of a diffusers pipeline class in ACCELERATED (one class per stock class)."""
    if cls not in _FAST_CLASSES:
        _FAST_CLASSES[cls] = type(f"Fast{cls.__name__}", (FastFamilyPipeline, cls), {"__module__": __name__})
    return _FAST_CLASSES[cls]


def is_accelerated(pipe) -> bool:
    return type(pipe).__name__ in ACCELERATED and type(pipe) is getattr(diffusers, type(pipe).__name__)


def check_family(pipe):
    """TypeError for a pipeline optimize() does not take, naming the ones it does."""
    supported = ", ".join(("QwenImagePipeline",) + ACCELERATED)
    raise TypeError(f"optimize() takes one of diffusers' {supported}; got {type(pipe).__name__} (its stock "
                    "pipeline runs as is)")


def optimize_family(pipe, config: FastConfig, device, enhance_prompt):
    """pipe (is_accelerated) with its transformer converted on `device` and its class made fast_class(type(pipe)),
    in place. The options that would change what its own loop computes are refused, not ignored."""
    if enhance_prompt is not None and enhance_prompt is not False:
        raise ValueError(f"enhance_prompt is supported by the text-to-image QwenImageFastPipeline only, not by "
                         f"{type(pipe).__name__}")
    if config.parallel != "none":
        raise ValueError(f"FastConfig(parallel={config.parallel!r}) is supported by the text-to-image "
                         f"QwenImageFastPipeline only, not by {type(pipe).__name__}; render one image per process "
                         "instead (the CLI splits the work by RANK)")
    if config.memory != "fast":
        raise ValueError(f"FastConfig(memory={config.memory!r}) is supported by the text-to-image "
                         f"QwenImageFastPipeline only, not by {type(pipe).__name__} (its own loop computes the "
                         "modulation in every forward, so those weights must be on the GPU)")
    if config.scheduler != "euler" or config.cfg_fraction < 1:
        raise ValueError(f"FastConfig(scheduler={config.scheduler!r}, cfg_fraction={config.cfg_fraction:g}) changes "
                         f"the text-to-image pipeline's loop, which {type(pipe).__name__} does not run; replace "
                         "pipe.scheduler to sample otherwise")
    if config.fused_transformer and not isinstance(pipe.transformer, FastQwenImageTransformer):
        pipe.register_modules(transformer=fast_transformer(pipe.transformer, config, device))
    pipe.__class__ = fast_class(type(pipe))
    pipe.fast_config = config
    fast = pipe._fast_transformer()
    pipe._graphs = GraphedForward(fast, max_graphs=MAX_GRAPHS) if config.cuda_graphs and fast is not None else None
    return pipe


@contextlib.contextmanager
def decoding_2d(vae, decoded: list):
    """vae.decode as decode_image (vae.py) wherever can_decode_image says that gives what it gives, for the
    pipeline's own decode calls inside this block; appends to `decoded` each time it did. An instance attribute
    `decode` set before (someone's wrapper) is called otherwise and put back after."""
    stock, own = vae.decode, vae.__dict__.get("decode")

    def decode(z, return_dict: bool = True):
        if not can_decode_image(vae, z, has_offload_hooks(vae)):
            return stock(z, return_dict=return_dict)
        decoded.append(True)
        image = decode_image(vae, z)
        return DecoderOutput(sample=image) if return_dict else (image,)

    vae.decode = decode
    try:
        yield
    finally:
        del vae.decode
        if own is not None:
            vae.decode = own


FastQwenImageImg2ImgPipeline = fast_class(diffusers.QwenImageImg2ImgPipeline)
FastQwenImageInpaintPipeline = fast_class(diffusers.QwenImageInpaintPipeline)
FastQwenImageEditPipeline = fast_class(diffusers.QwenImageEditPipeline)
FastQwenImageEditPlusPipeline = fast_class(diffusers.QwenImageEditPlusPipeline)
FastQwenImageEditInpaintPipeline = fast_class(diffusers.QwenImageEditInpaintPipeline)
FastQwenImageLayeredPipeline = fast_class(diffusers.QwenImageLayeredPipeline)
FastQwenImageControlNetPipeline = fast_class(diffusers.QwenImageControlNetPipeline)
FastQwenImageControlNetInpaintPipeline = fast_class(diffusers.QwenImageControlNetInpaintPipeline)


def load_stock(pipeline_class: type, path_or_id, *args, **kwargs):
    """diffusers' pipeline_class.from_pretrained, in BF16 unless dtype is given; without torchvision, an edit
    checkpoint's processor is built as vl_processor.py says (diffusers' own loading of it needs torchvision)."""
    if "torch_dtype" not in kwargs:  # diffusers 0.42 names it dtype (torch_dtype is deprecated there)
        kwargs.setdefault("dtype", torch.bfloat16)
    takes_processor = "processor" in inspect.signature(pipeline_class.__init__).parameters
    if takes_processor and "processor" not in kwargs and not is_torchvision_available():
        from .pipelines.qwen_image.transformer import local_folder
        from .vl_processor import load_processor_without_torchvision

        kwargs["processor"] = load_processor_without_torchvision(local_folder(path_or_id, "processor"))
    return pipeline_class.from_pretrained(path_or_id, *args, **kwargs)


def pipeline_class_name(path_or_id) -> str:
    """The `_class_name` of a checkpoint's model_index.json (a local folder, or a hub id: read from the hub)."""
    return diffusers.DiffusionPipeline.load_config(str(path_or_id))["_class_name"]


def from_pretrained(path_or_id, fast_config: FastConfig | str | None = None, device=None, **kwargs):
    """The fast pipeline for whatever a checkpoint holds: QwenImageFastPipeline for a text-to-image one (stock or
    saved by it), else the fast class of its pipeline in ACCELERATED (e.g. Qwen/Qwen-Image-Edit-2511 ->
    FastQwenImageEditPlusPipeline). Another pipeline class: TypeError naming those supported."""
    from .pipeline import QwenImageFastPipeline

    name = pipeline_class_name(path_or_id)
    if name in ("QwenImagePipeline", "QwenImageFastPipeline"):
        return QwenImageFastPipeline.from_pretrained(path_or_id, fast_config=fast_config, device=device, **kwargs)
    if name not in ACCELERATED:
        raise TypeError(f"{path_or_id} is a {name} checkpoint; qwen-image-fast accelerates QwenImagePipeline, "
                        f"{', '.join(ACCELERATED)}")
    return fast_class(getattr(diffusers, name)).from_pretrained(path_or_id, fast_config=fast_config, device=device,
                                                                **kwargs)
