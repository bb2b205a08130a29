"""Single checkpoint files into the fast transformers (core/single_file/), each format written by the tests from
tiny random weights (core/single_file/writers.py, which names the tools whose rules it follows), against the same
weights loaded from a diffusers folder and against stock diffusers holding what the file means."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from diffusers import QwenImageTransformer2DModel
from helpers import assert_close
from safetensors.torch import load_file, save_file
from single_file_fixtures import CONFIG, meaning, write_comfy_files

from qwen_image_fast.kernels._utils import rel_rms_error
from qwen_image_fast.pipelines.core.config import FastTransformerConfig
from qwen_image_fast.pipelines.core.optimizations import BY_NAME
from qwen_image_fast.pipelines.core.single_file import writers
from qwen_image_fast.pipelines.core.single_file.formats import COMFY_PREFIX, CheckpointFileError
from qwen_image_fast.pipelines.qwen_image.model.transformer import FastQwenImageTransformer

FP8_OFF, FP8_ON = FastTransformerConfig(fp8=False), FastTransformerConfig(fp8=True)


def stock_model(seed: int = 0) -> QwenImageTransformer2DModel:
    torch.manual_seed(seed)
    model = QwenImageTransformer2DModel(**CONFIG).eval()
    with torch.no_grad():  # non-trivial biases and norm weights, so a dropped one shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Every format of the same BF16 weights, and their diffusers folder."""
    root = tmp_path_factory.mktemp("single_files")
    stock = stock_model().to(torch.bfloat16)
    stock.save_pretrained(root / "folder")
    state = stock.state_dict()
    return {fmt: writers.write(state, root / f"{fmt}.{'gguf' if fmt.startswith('gguf') else 'safetensors'}", fmt)
            for fmt in writers.FORMATS} | {"folder": root / "folder"}


def inputs(batch: int = 2):
    torch.manual_seed(1)
    return dict(hidden_states=torch.randn(batch, 16, 16), encoder_hidden_states=torch.randn(batch, 5, 16),
                encoder_hidden_states_mask=None, timestep=torch.tensor([0.3, 0.8])[:batch],
                img_shapes=[[(1, 4, 4)]] * batch)


@torch.no_grad()
def run(model):
    return model(**inputs()).sample


@pytest.mark.parametrize("fmt", ["diffusers_bf16", "comfyui_bf16"])
def test_a_bf16_file_loads_as_its_diffusers_folder_does(files, fmt):
    """Bit for bit the model from_diffusers makes of the same weights from the folder (FP8 codes and scales too)."""
    stock = QwenImageTransformer2DModel.from_pretrained(files["folder"], torch_dtype=torch.bfloat16)
    for config in (FP8_ON, FP8_OFF):
        ours = FastQwenImageTransformer.from_single_file(files[fmt], config=files["folder"], fast_config=config)
        folder = FastQwenImageTransformer.from_diffusers(stock, config)
        a, b = ours.state_dict(), folder.state_dict()
        assert a.keys() == b.keys()
        assert all(a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8) if a[k].dtype.itemsize == 1 else
                                                            a[k], b[k].view(torch.uint8) if b[k].dtype.itemsize == 1
                                                            else b[k]) for k in a)
        assert ours.single_file.applied == (("single_file", fmt),)


@pytest.mark.parametrize("fmt", ["comfyui_scaled_fp8", "comfyui_quant_fp8", "comfyui_fp8"])
def test_fp8_codes_and_scales_are_kept_bit_for_bit(files, fmt):
    raw = {k.removeprefix(COMFY_PREFIX): v for k, v in load_file(files[fmt]).items()}
    ours = FastQwenImageTransformer.from_single_file(files[fmt], config=CONFIG, fast_config=FP8_ON,
                                                     torch_dtype=torch.float32)
    block = ours.transformer_blocks[1]
    parts = [raw[f"transformer_blocks.1.attn.{n}.weight"] for n in ("to_q", "to_k", "to_v")]
    scales = [raw.get(f"transformer_blocks.1.attn.{n}.scale_weight", raw.get(
        f"transformer_blocks.1.attn.{n}.weight_scale", torch.ones(()))) for n in ("to_q", "to_k", "to_v")]
    assert torch.equal(block.img_qkv.weight_q.view(torch.uint8), torch.cat(parts).view(torch.uint8))
    assert torch.equal(block.img_qkv.weight_scale, torch.cat([s.float().expand(p.shape[0]) for s, p in
                                                               zip(scales, parts)]))
    # the modulation linears stay in the model's dtype: dequantized from the file's FP8, and applied says so
    assert block.img_mod[1].weight.dtype == torch.float32
    source = "fp8_e4m3fn" if fmt == "comfyui_fp8" else "fp8_e4m3fn_scaled"
    assert ("dequantized", source) in ours.single_file.applied and not any(
        name == "requantized" for name, _ in ours.single_file.applied)


@pytest.mark.parametrize("fmt", ["comfyui_bf16", "comfyui_scaled_fp8", "comfyui_quant_fp8", "comfyui_fp8",
                                 "gguf_q8_0", "gguf_q4_0"])
def test_the_forward_equals_stock_holding_what_the_file_means(files, fmt):
    """fp32, FP8 off: to 1e-5 (every format is exact there: its values computed in fp32); FP8 on: inside the fp8
    bound, and for GGUF the requantization is labelled (the registry's lossy `requantized`)."""
    stock = QwenImageTransformer2DModel(**CONFIG).eval()
    stock.load_state_dict(meaning(files[fmt]))
    ref = run(stock)
    exact = FastQwenImageTransformer.from_single_file(files[fmt], config=CONFIG, fast_config=FP8_OFF,
                                                      torch_dtype=torch.float32)
    assert_close(run(exact), ref, tol=1e-5)
    fp8 = FastQwenImageTransformer.from_single_file(files[fmt], config=CONFIG, fast_config=FP8_ON,
                                                    torch_dtype=torch.float32)
    assert 0 < rel_rms_error(run(fp8), ref) <= BY_NAME["fp8"].bound.tiny
    requantized = [value for name, value in fp8.single_file.applied if name == "requantized"]
    assert requantized == ([fmt] if fmt.startswith("gguf") else [])
    assert BY_NAME["requantized"].kind == "lossy" and BY_NAME["requantized"].bound is BY_NAME["fp8"].bound


def test_diffusers_own_from_single_file_and_ours_load_the_same_model(files):
    """The same file and config= through stock diffusers' QwenImageTransformer2DModel.from_single_file and ours
    (fp32, FP8 off): the same forward; the arguments that fetch a config are refused where there is none to fetch,
    and a hub id takes them (offline here: huggingface_hub's own error, not an ignored argument)."""
    stock = QwenImageTransformer2DModel.from_single_file(str(files["diffusers_bf16"]), config=str(files["folder"]),
                                                         torch_dtype=torch.float32)
    ours = FastQwenImageTransformer.from_single_file(files["diffusers_bf16"], config=files["folder"],
                                                     torch_dtype=torch.float32, fast_config=FP8_OFF)
    assert_close(run(ours), run(stock), tol=1e-5)
    for kwargs in (dict(token="t"), dict(subfolder="transformer", config=CONFIG), dict(local_files_only=True)):
        with pytest.raises(ValueError, match="nothing is fetched"):
            FastQwenImageTransformer.from_single_file(files["diffusers_bf16"], **kwargs)
    from huggingface_hub.errors import LocalEntryNotFoundError

    with pytest.raises((LocalEntryNotFoundError, OSError)):
        FastQwenImageTransformer.from_single_file(files["diffusers_bf16"], config="someone/not-cached",
                                                  subfolder="transformer", local_files_only=True)


def test_the_config_is_read_off_the_file(files, tmp_path):
    """No config=: the file's shapes give it; the Edit-2511 marker gives zero_cond_t; Layered is refused."""
    # CONFIG's rotary axes sum to its head width 16; the stock default's (16, 56, 56) to 128: a file of 128-wide
    # heads infers, one of 16-wide heads asks for config=
    with pytest.raises(CheckpointFileError, match="pass config="):
        FastQwenImageTransformer.from_single_file(files["comfyui_bf16"])
    torch.manual_seed(0)
    wide = QwenImageTransformer2DModel(**{**CONFIG, "attention_head_dim": 128, "axes_dims_rope": (16, 56, 56),
                                          "num_attention_heads": 1, "num_layers": 3})
    state = {COMFY_PREFIX + k: v for k, v in wide.state_dict().items()}
    save_file(state, tmp_path / "plain.safetensors")
    save_file({**state, COMFY_PREFIX + "__index_timestep_zero__": torch.empty(0)}, tmp_path / "2511.safetensors")
    plain = FastQwenImageTransformer.from_single_file(tmp_path / "plain.safetensors", fast_config=FP8_OFF)
    expected = {**{k: wide.config[k] for k in CONFIG}, "attention_head_dim": 128, "num_attention_heads": 1,
                "num_layers": 3, "zero_cond_t": False}
    assert {k: plain.config[k] for k in expected} == {**expected, "axes_dims_rope": plain.config["axes_dims_rope"]}
    edit = FastQwenImageTransformer.from_single_file(tmp_path / "2511.safetensors", fast_config=FP8_OFF)
    assert edit.config["zero_cond_t"] is True
    save_file({**state, COMFY_PREFIX + "time_text_embed.addition_t_embedding.weight": torch.zeros(2, 128)},
              tmp_path / "layered.safetensors")
    with pytest.raises(CheckpointFileError, match="Layered"):
        FastQwenImageTransformer.from_single_file(tmp_path / "layered.safetensors")


def test_bad_files_are_refused_in_one_line_naming_the_first_key(files, tmp_path):
    state = load_file(files["comfyui_scaled_fp8"])
    dropped = COMFY_PREFIX + "transformer_blocks.1.attn.to_k."  # the layer: its weight and scales
    save_file({k: v for k, v in state.items() if not k.startswith(dropped)}, tmp_path / "missing.safetensors")
    save_file({**state, COMFY_PREFIX + "transformer_blocks.0.extra.weight": torch.zeros(2)},
              tmp_path / "unknown.safetensors")
    data = files["comfyui_scaled_fp8"].read_bytes()
    (tmp_path / "truncated.safetensors").write_bytes(data[: len(data) // 2])
    save_file({"encoder.conv1.weight": torch.zeros(4, 3, 3, 3, 3)}, tmp_path / "vae.safetensors")
    (tmp_path / "truncated.gguf").write_bytes(files["gguf_q8_0"].read_bytes()[:4000])
    (tmp_path / "junk.safetensors").write_bytes(b"not a checkpoint at all")
    cases = {"missing": "missing 'transformer_blocks.1.attn.to_k.weight'",
             "unknown": "unknown key 'transformer_blocks.0.extra.weight'",
             "truncated": "truncated", "vae": "is not a QwenImageTransformer2DModel file"}
    for name, message in cases.items():
        with pytest.raises(CheckpointFileError, match=message) as e:
            FastQwenImageTransformer.from_single_file(tmp_path / f"{name}.safetensors", config=files["folder"])
        assert "\n" not in str(e.value)
    with pytest.raises(CheckpointFileError, match="not a readable safetensors or GGUF file"):
        FastQwenImageTransformer.from_single_file(tmp_path / "junk.safetensors", config=files["folder"])
    with pytest.raises(CheckpointFileError, match="not a readable GGUF file"):
        FastQwenImageTransformer.from_single_file(tmp_path / "truncated.gguf", config=files["folder"])
    with pytest.raises(ValueError, match="quantization_config"):
        FastQwenImageTransformer.from_single_file(files["comfyui_bf16"], quantization_config=object())
    # ComfyUI's other quantized formats are named, not guessed at
    nvfp4 = dict(state)
    nvfp4[COMFY_PREFIX + "transformer_blocks.0.attn.to_q.comfy_quant"] = torch.tensor(
        list(json.dumps({"format": "nvfp4"}).encode()), dtype=torch.uint8)
    save_file(nvfp4, tmp_path / "nvfp4.safetensors")
    with pytest.raises(CheckpointFileError, match="'nvfp4'"):
        FastQwenImageTransformer.from_single_file(tmp_path / "nvfp4.safetensors", config=files["folder"])


def test_qwen21_comfyui_file_with_its_fused_swiglu(tmp_path):
    """ComfyUI's 2.1 layout fuses SwiGLU's gate and up projections (gate rows first, as diffusers'
    convert_qwen_image21_transformer_checkpoint_to_diffusers splits them): scaled FP8 loads with its codes, and the
    forward equals stock diffusers' holding what the file means."""
    from qwen_image_fast.pipelines.qwen_image21.model import FastQwenImage21Transformer
    from qwen_image_fast.pipelines.tiny import tiny_qwen21_components

    stock = tiny_qwen21_components()["transformer"]
    state = {}
    for name, t in stock.state_dict().items():
        if name.endswith("img_mlp.gate_layer.weight"):
            up = stock.state_dict()[name.replace("gate_layer", "proj")]
            state[name.replace("gate_layer", "gate_up")] = torch.cat([t, up])
        elif not name.endswith("img_mlp.proj.weight"):
            state[name] = t
    path = writers.write(state, tmp_path / "qwen21.safetensors", "comfyui_scaled_fp8")
    ours = FastQwenImage21Transformer.from_single_file(path, config=dict(stock.config), fast_config=FP8_OFF,
                                                       torch_dtype=torch.float32)
    meant = meaning(path)
    for name in [n for n in meant if n.endswith("gate_up.weight")]:
        meant[name.replace("gate_up", "gate_layer")], meant[name.replace("gate_up", "proj")] = meant.pop(name).chunk(2)
    stock.load_state_dict(meant)
    torch.manual_seed(0)  # what QwenImage21Pipeline hands the transformer: 6 text tokens, a 4x4-token target
    x = dict(hidden_states=torch.randn(1, 16, 16), encoder_hidden_states=torch.randn(1, 6, 24),
             timestep=torch.tensor([0.5]), img_shapes=[[(1, 4, 4)]],
             img_mask=torch.cat([torch.zeros(6, dtype=torch.bool), torch.ones(4, dtype=torch.bool)])[None])
    with torch.no_grad():
        assert_close(ours(**x).sample, stock(**x).sample, tol=1e-5)
    fp8 = FastQwenImage21Transformer.from_single_file(path, config=dict(stock.config), fast_config=FP8_ON)
    raw = load_file(path)
    gate_up = raw[COMFY_PREFIX + "transformer_blocks.0.img_mlp.gate_up.weight"]
    assert torch.equal(fp8.transformer_blocks[0].gate_up.weight_q.view(torch.uint8), gate_up.view(torch.uint8))


# ---- ComfyUI's three files into a pipeline


@pytest.fixture(scope="module")
def comfy_files(tmp_path_factory):
    return write_comfy_files(tmp_path_factory.mktemp("comfy_files"))


def test_comfyuis_three_files_render_as_stock_holding_what_they_mean(comfy_files):
    from qwen_image_fast import FastConfig, from_single_files

    fast = from_single_files(comfy_files["base"], transformer=comfy_files["transformer"],
                             text_encoder=comfy_files["text_encoder"], vae=comfy_files["vae"],
                             fast_config=FastConfig(fp8=False), dtype=torch.float32)
    case = dict(prompt="a cat", negative_prompt="blurry", height=32, width=48, num_inference_steps=3,
                true_cfg_scale=4.0)
    ours = fast(**case, output_type="latent", generator=torch.Generator().manual_seed(0)).images
    ref = comfy_files["stock"](**case, output_type="latent", generator=torch.Generator().manual_seed(0)).images
    assert_close(ours, ref, tol=1e-5)
    assert "single_file:comfyui_scaled_fp8" in fast.applied and "dequantized:fp8_e4m3fn_scaled" in fast.applied
    images = fast(**case, output_type="pt", generator=torch.Generator().manual_seed(0)).images
    stock_images = comfy_files["stock"](**case, output_type="pt", generator=torch.Generator().manual_seed(0)).images
    assert_close(images, stock_images, tol=1e-5)  # the VAE from its Wan-layout file decodes as stock's
    with pytest.raises(CheckpointFileError, match="not a Qwen2.5-VL text encoder file"):
        from_single_files(comfy_files["base"], transformer=comfy_files["transformer"], text_encoder=comfy_files["vae"],
                          dtype=torch.float32)


def test_render_takes_the_three_files_says_what_each_is_and_refuses_a_wrong_one(comfy_files, tmp_path, capsys):
    """The command line: --model FILE with --base / --text-encoder / --vae; --dry-run names each file and what
    will be dequantized; the images record the files and what loading did; a wrong file exits 2 in one line with
    nothing written."""
    from qwen_image_fast.command import main

    files = ["--model", str(comfy_files["transformer"]), "--base", str(comfy_files["base"]), "--text-encoder",
             str(comfy_files["text_encoder"]), "--vae", str(comfy_files["vae"]), "--device", "cpu", "--width", "32",
             "--height", "32", "--steps", "2"]
    assert main(["render", *files, "--out", str(tmp_path / "dry"), "--dry-run", "a cat"]) == 0
    report = capsys.readouterr().out
    assert "single_file:comfyui_scaled_fp8" in report and "dequantized:fp8_e4m3fn_scaled" in report
    assert "dequantized from fp8_e4m3fn_scaled: img_mod.1.weight, txt_mod.1.weight" in report
    assert "text encoder file text_encoder.safetensors" in report and not (tmp_path / "dry").exists()
    assert main(["render", *files, "--out", str(tmp_path / "out"), "a cat"]) == 0
    record = json.loads((tmp_path / "out" / "manifest.jsonl").read_text().splitlines()[0])
    assert record["model"].startswith(str(comfy_files["transformer"])) and str(comfy_files["vae"]) in record["model"]
    assert "single_file:comfyui_scaled_fp8" in record["applied"]
    with pytest.raises(SystemExit) as exit_info:  # diffusers' own pipeline cannot take the files
        main(["render", *files, "--preset", "baseline", "--out", str(tmp_path / "stock"), "a cat"])
    assert exit_info.value.code == 2 and not (tmp_path / "stock").exists()
    assert "--preset baseline runs diffusers' own pipeline" in capsys.readouterr().err
    wrong = [*files[:2], "--model", str(comfy_files["vae"])]  # argparse keeps the last --model
    with pytest.raises(SystemExit) as exit_info:
        main(["render", *files, *wrong[2:], "--out", str(tmp_path / "wrong"), "a cat"])
    assert exit_info.value.code == 2 and not (tmp_path / "wrong").exists()
    assert "is not a QwenImageTransformer2DModel file" in capsys.readouterr().err.strip().splitlines()[-1]


def test_q8_0_in_torch_is_ggufs_own_byte_for_byte():
    """The torch Q8_0 writer and reader (threads: the benchmark's 20B parameters) against gguf-py's numpy, on blocks
    with ties at .5, a zero block and one of a single value."""
    import gguf

    from qwen_image_fast.pipelines.core.single_file.formats import dequantize_q8_0

    torch.manual_seed(0)
    x = torch.randn(16, 256) * 0.02
    x[0, :32], x[1, :32], x[2, :32] = 0, 0.5, torch.arange(32) - 15.5
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    ours, theirs = writers.quantize_q8_0(x).numpy(), gguf.quants.quantize(x.numpy(), q8_0)
    assert ours.shape == theirs.shape and (ours == theirs).all()
    assert np.array_equal(dequantize_q8_0(torch.from_numpy(theirs)).numpy(), gguf.quants.dequantize(theirs, q8_0))


def resident_file_pages_mib() -> float:
    """This process's resident pages that are a mapped file's (RssFile), MiB."""
    line = next(x for x in open("/proc/self/status") if x.startswith("RssFile:"))
    return int(line.split()[1]) / 1024


def test_a_file_read_whole_leaves_one_tensor_resident_not_the_file(tmp_path):
    """Reading every tensor of a 128 MiB file leaves none of its mapped pages resident in this process (they would
    count in its peak memory as the file's size: the benchmark's 20 GB), and each read is its own memory holding the
    file's bytes."""
    from qwen_image_fast.pipelines.core.single_file.formats import CheckpointFile

    torch.manual_seed(0)
    state = {f"w{i}": torch.randn(4096, 2048) for i in range(4)}  # 4 x 32 MiB
    save_file(state, tmp_path / "big.safetensors")
    file, before = CheckpointFile(tmp_path / "big.safetensors"), resident_file_pages_mib()
    read = {name: file.get(name).values for name in file.names}
    assert resident_file_pages_mib() - before < 16
    for name, tensor in state.items():
        assert torch.equal(read[name], tensor)
        assert read[name].untyped_storage().nbytes() == tensor.numel() * 4  # not a view of the map


PEAK_OF_LOAD_WEIGHTS = """
import sys, torch
from qwen_image_fast.pipelines.core.model.checkpoint import load_weights
def status(key):
    return int(next(x for x in open("/proc/self/status") if x.startswith(key)).split()[1]) / 1024
torch.empty(1, device=sys.argv[2])  # the CUDA context, before the measure
before = status("VmRSS:")
load_weights(__import__("pathlib").Path(sys.argv[1]), torch.device(sys.argv[2]))
print(status("VmHWM:") - before)
"""


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_fast_folder_loads_its_weights_one_tensor_at_a_time(tmp_path, device):
    """A fast checkpoint folder's weights (core/model/checkpoint.load_weights, in shards as save_pretrained writes
    them) read through the same mapped reader: safetensors' own load_file's tensors, dtypes included (FP8 codes,
    fp32 scales), with the files' pages resident one tensor at a time (the process's peak: the tensors it keeps on
    the host, not the files as well)."""
    from qwen_image_fast.pipelines.core.model.checkpoint import load_weights

    torch.manual_seed(0)
    shards = {"diffusion_pytorch_model-00001-of-00002.safetensors": {
                  f"w{i}": torch.randn(4096, 2048) for i in range(4)},
              "diffusion_pytorch_model-00002-of-00002.safetensors": {
                  "codes": torch.randn(4096, 4096).to(torch.float8_e4m3fn), "scale": torch.rand(4096),
                  "bias": torch.randn(7).bfloat16()}}
    for name, state in shards.items():
        save_file(state, tmp_path / name)
    weight_map = {key: name for name, state in shards.items() for key in state}
    (tmp_path / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    # the host's peak in a fresh process: the tensors read when they stay on the CPU (144 MiB), and one tensor's
    # mapped pages at a time (at most 32 MiB), not a file's (safetensors' load_file onto a GPU keeps the first
    # file's 128 MiB of pages mapped until that file is done)
    peak = subprocess.run([sys.executable, "-c", PEAK_OF_LOAD_WEIGHTS, str(tmp_path), device], capture_output=True,
                          text=True, check=True).stdout
    assert float(peak) < (144 if device == "cpu" else 0) + 64, f"load_weights raised the process's peak by {peak} MiB"
    state = {key: tensor.cpu() for key, tensor in load_weights(tmp_path, torch.device(device)).items()}
    theirs = {key: tensor for name in shards for key, tensor in load_file(tmp_path / name).items()}
    assert sorted(state) == sorted(theirs)
    for key, tensor in theirs.items():
        assert state[key].dtype == tensor.dtype and torch.equal(state[key].view(torch.uint8), tensor.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["comfyui_scaled_fp8", "gguf_q8_0", "comfyui_bf16"])
def test_a_file_loads_onto_the_gpu_as_onto_the_cpu(files, fmt):
    """Straight onto the GPU (each tensor's bytes decoded, dequantized and quantized there): bit for bit the model a
    CPU load gives (the CPU loads are checked against stock above), and its forward runs there."""
    kwargs = dict(config=CONFIG, fast_config=FP8_ON, torch_dtype=torch.bfloat16)
    cpu = FastQwenImageTransformer.from_single_file(files[fmt], **kwargs).state_dict()
    gpu = FastQwenImageTransformer.from_single_file(files[fmt], device="cuda", **kwargs)
    for name, tensor in gpu.state_dict().items():
        assert tensor.device.type == "cuda" and tensor.dtype == cpu[name].dtype, name
        assert torch.equal(tensor.cpu().view(torch.uint8), cpu[name].view(torch.uint8)), name
    x = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs().items()}
    with torch.no_grad():
        out = gpu(**{**x, "hidden_states": x["hidden_states"].bfloat16(),
                     "encoder_hidden_states": x["encoder_hidden_states"].bfloat16()}).sample
    assert out.shape == x["hidden_states"].shape and bool(torch.isfinite(out).all())
