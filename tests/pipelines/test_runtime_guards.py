"""The two checks every call makes before it replays CUDA graphs: offload hooks anywhere in a model
(runtime/offload.has_offload_hooks: a graph would read weights the hooks move) and weights that moved since the
graphs were captured (runtime/cuda_graph.Graphs.drop_if_weights_moved), on the tiny transformer's module tree."""

import pytest
import torch
from test_transformer import tiny_stock

from qwen_image_fast.pipelines.core.config import FastTransformerConfig
from qwen_image_fast.pipelines.qwen_image.model.transformer import FastQwenImageTransformer
from qwen_image_fast.pipelines.core.runtime.cuda_graph import Graphs
from qwen_image_fast.pipelines.core.runtime.offload import has_offload_hooks


@pytest.fixture
def fast():
    return FastQwenImageTransformer.from_diffusers(tiny_stock(), FastTransformerConfig(fp8=True))  # FP8: buffers


def test_offload_hooks_are_found_at_any_depth(fast):
    from accelerate.hooks import ModelHook as AccelerateHook, add_hook_to_module, remove_hook_from_module
    from diffusers.hooks import HookRegistry, ModelHook

    leaf = fast.transformer_blocks[1].img_fc1
    assert not has_offload_hooks(fast)
    add_hook_to_module(leaf, AccelerateHook())  # sequential CPU offload puts its hooks on leaves
    assert has_offload_hooks(fast)
    remove_hook_from_module(leaf)
    assert not has_offload_hooks(fast)
    registry = HookRegistry.check_if_exists_or_initialize(fast.transformer_blocks[0])
    registry.register_hook(ModelHook(), "group_offloading")
    assert has_offload_hooks(fast)
    registry.remove_hook("group_offloading")
    registry.register_hook(ModelHook(), "fbc_leader_block_hook")  # a step cache's hook moves no weights
    assert not has_offload_hooks(fast)


def test_graphs_are_dropped_when_a_weight_or_buffer_moves(fast):
    graphs = Graphs()

    def kept_after(change) -> bool:
        graphs.drop_if_weights_moved(fast)
        graphs.graphs[("key",)] = None  # a stand-in graph
        change()
        graphs.drop_if_weights_moved(fast)
        return ("key",) in graphs.graphs

    block = fast.transformer_blocks[1]
    assert kept_after(lambda: None)
    assert kept_after(lambda: block.img_fc1.bias.data.add_(1.0)), "an in-place change keeps the addresses"
    for module, name in ((block.img_fc1, "bias"), (block.img_mod[1], "weight"), (block.img_fc1, "weight_q")):
        tensor = getattr(module, name)
        assert not kept_after(lambda: setattr(tensor, "data", tensor.data.clone())), (module, name)
    assert not kept_after(lambda: block.txt_fc2.register_buffer("weight_scale", block.txt_fc2.weight_scale.clone()))
