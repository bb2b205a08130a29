"""The edit pipelines' Qwen2.5-VL processor (and Qwen-Image-2.1's Qwen3-VL one) where torchvision is missing (CPU
machines without its wheel, CI).

transformers' Qwen2VLProcessor needs torchvision for its video processor and for its default (fast) image
processor, so `from_pretrained` of an edit checkpoint fails without it. Qwen-Image never passes videos; the
processor below is transformers' own Qwen2VLProcessor (the same `<|image_pad|>` expansion and template handling)
with the PIL image processor (Qwen2VLImageProcessorPil: the same resize bounds, patching and normalization, PIL's
resampling instead of torchvision's) and a BaseVideoProcessor that is never called. Where torchvision is installed,
diffusers' own loading runs and this module is not used.
"""

from pathlib import Path
from unittest import mock

from transformers import Qwen2VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.video_processing_utils import BaseVideoProcessor


def processor_without_torchvision(image_processor: Qwen2VLImageProcessorPil, tokenizer,
                                  processor_class=Qwen2VLProcessor, **kwargs):
    """A Qwen2VLProcessor (or processor_class, e.g. Qwen-Image-2.1's Qwen3VLProcessor: that class, so that it saves
    as the real checkpoint's does) with a plain BaseVideoProcessor: its constructor checks the video processor
    against transformers' exported BaseVideoProcessor, a dummy that raises without torchvision, so that one check
    is relaxed while it runs."""
    check = processor_class.check_argument_for_proper_class

    def lenient_check(self, argument_name, argument):
        if argument_name == "video_processor" and isinstance(argument, BaseVideoProcessor):
            return type(argument)
        return check(self, argument_name, argument)

    with mock.patch.object(processor_class, "check_argument_for_proper_class", lenient_check):
        return processor_class(image_processor=image_processor, tokenizer=tokenizer,
                               video_processor=BaseVideoProcessor(), **kwargs)


def load_processor_without_torchvision(folder: Path) -> Qwen2VLProcessor:
    """A pipeline's `processor` folder (diffusers' layout: the processor's and its tokenizer's files), built as
    above: the processor class its processor_config.json names (Qwen2VLProcessor if none; Qwen-Image-2.1's is a
    Qwen3VLProcessor), with the chat template saved beside it."""
    import json

    import transformers
    from transformers import AutoTokenizer

    config = folder / "processor_config.json"
    name = json.loads(config.read_text()).get("processor_class") if config.exists() else None
    known = ("Qwen2VLProcessor", "Qwen3VLProcessor")
    processor_class = getattr(transformers, name) if name in known else Qwen2VLProcessor
    template = folder / "chat_template.jinja"
    extra = dict(chat_template=template.read_text()) if template.exists() else {}
    return processor_without_torchvision(Qwen2VLImageProcessorPil.from_pretrained(folder),
                                         AutoTokenizer.from_pretrained(folder), processor_class, **extra)
