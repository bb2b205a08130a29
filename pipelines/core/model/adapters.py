"""LoRA adapters on the fast transformer through diffusers' PEFT API (PeftAdapterMixin's methods, with its
semantics; lora.py says where adapters attach and how their state follows peft's), and carrying over the adapters a
stock model already has."""

import functools

import torch
import torch.nn as nn
from diffusers.hooks.group_offloading import _maybe_remove_and_reapply_group_offloading
from diffusers.loaders.lora_base import _func_optionally_disable_offloading
from diffusers.utils import logging

from ....kernels.fp8 import quantize_fp8_rowwise_ref
from ..runtime.context import get_context
from ..runtime.offload import has_offload_hooks
from .linear import FastLinear
from .lora import LoraLinear, LoraTargetLinear, site_of
from .unsupported import BASELINE_ADVICE, HOTSWAP_ADVICE

logger = logging.get_logger(__name__)
# the warnings diffusers' PeftAdapterMixin gives, under its logger: where users' verbosity settings and diffusers' own
# LoRA tests look for them
stock_logger = logging.get_logger("diffusers.loaders.peft")

def peft_lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """name -> module of every peft LoRA layer (duck-typed on peft's BaseTunerLayer attributes, so peft need not be
    installed to find out there is none)."""
    return {name: m for name, m in model.named_modules()
            if hasattr(m, "lora_A") and hasattr(m, "merged_adapters") and hasattr(m, "get_base_layer")}


def check_carriable(stock, peft_layers: dict[str, nn.Module]):
    """Raise unless the stock model's peft adapters can be carried over exactly: LoRA on linears (no DoRA, bias,
    embedding), none fused into the weights, every layer in the same active/enabled state."""
    for name, layer in peft_layers.items():
        if not isinstance(layer.get_base_layer(), nn.Linear) or getattr(layer, "lora_embedding_A", None):
            raise NotImplementedError(f"the peft adapter at {name} is not a LoRA on a linear layer; " + BASELINE_ADVICE)
        for adapter in layer.lora_A:
            if layer.use_dora.get(adapter) or getattr(layer, "lora_bias", {}).get(adapter):
                raise NotImplementedError(f"adapter {adapter!r} at {name} uses DoRA or a LoRA bias; " + BASELINE_ADVICE)
        if layer.merged_adapters:
            raise ValueError(
                f"adapter(s) {layer.merged_adapters} are fused into the stock weights and still loaded (at {name}): "
                "converting would leave them impossible to unfuse. Either pipe.unload_lora_weights() first (the fused "
                "weights are converted as they are), or pipe.unfuse_lora() (the adapters are carried over unfused)")
    states = {(tuple(m.active_adapters), bool(m.disable_adapters)) for m in peft_layers.values()}
    if len(states) > 1:
        raise NotImplementedError(f"the LoRA layers are in different states {sorted(states)}; set them alike with "
                                  "pipe.set_adapters(...) / enable_lora() before converting")

class LoraAdapters:
    """Mixed into the fast transformers (FastQwenImageTransformer, FastQwenImage21Transformer): diffusers' PEFT API
    (load_lora_adapter, set_adapters, fuse_lora, ...). The model names its sites (lora_sites: stock block module ->
    its fused linear and part, lora.py), its block class (block_class) and the stock model (stock_model_name), and
    keeps lora_state and weight_source."""

    def save_pretrained(self, save_directory, is_main_process: bool = True, save_function=None,
                        safe_serialization: bool = True, variant: str | None = None, max_shard_size="10GB",
                        push_to_hub: bool = False, **kwargs):
        """ModelMixin.save_pretrained (the same arguments, named: a pipeline's save_pretrained passes those its
        components' signatures name), refused while LoRA adapters are loaded: the checkpoint would silently lack
        them (they are not weights of the model)."""
        if self.lora_state.configs:
            raise ValueError(
                f"save_pretrained with LoRA adapters {sorted(self.lora_state.configs)} loaded would write the model "
                "without them: unload_lora_weights() first and keep the LoRA files to load again, or fuse the LoRA "
                "into the stock model, unload it there and convert (optimize) that")
        return super().save_pretrained(save_directory, is_main_process=is_main_process, save_function=save_function,
                                       safe_serialization=safe_serialization, variant=variant,
                                       max_shard_size=max_shard_size, push_to_hub=push_to_hub, **kwargs)

    def lora_key(self) -> tuple:
        """What a forward's output depends on beyond its arguments and the weights: the LoRA scale of the forward
        and the adapters' state (a CUDA graph runs them as captured: part of its key)."""
        return get_context().lora_scale, self.lora_state.version

    # ---- carried over from a stock model (from_diffusers)

    def _carry_lora(self, stock, peft_layers: dict[str, nn.Module]):
        """The stock model's peft adapters (check_carriable passed), as they are: factors, scaling, active set."""
        for name, layer in peft_layers.items():
            if self.get_submodule(site_of(name, self.lora_sites)[0]) is layer:  # shared with stock: its base layer
                self._replace_unshared(name, layer.get_base_layer())
        first = next(iter(peft_layers.values()))
        state = self.lora_state
        for adapter, peft_config in stock.peft_config.items():
            state.configs[adapter] = peft_config
            state.layer_scale[adapter] = 1.0
        weights: dict[str, set] = {a: set() for a in state.configs}
        for name, layer in peft_layers.items():
            lora, device = self._lora_host(name)
            for adapter in layer.lora_A:
                r, alpha = layer.r[adapter], layer.lora_alpha[adapter]
                base = alpha / (r ** 0.5 if stock.peft_config[adapter].use_rslora else r)
                weights[adapter].add(round(layer.scaling[adapter] / base, 12))
                lora.add(name, adapter, layer.lora_A[adapter].weight.detach().to(device, self.dtype),
                         layer.lora_B[adapter].weight.detach().to(device, self.dtype), base)
        uneven = {a: sorted(w) for a, w in weights.items() if len(w) > 1}
        if uneven:
            raise NotImplementedError(f"adapter weights differ between layers {uneven}; the fast transformer keeps one "
                                      "weight per adapter: set_adapters(names, weights) with floats before converting")
        for adapter, w in weights.items():
            state.weight[adapter] = w.pop() if w else 1.0
        state.active, state.enabled = list(first.active_adapters), not first.disable_adapters
        self._lora_changed()

    # ---- diffusers' API

    @property
    def peft_config(self) -> dict:
        """adapter name -> peft LoraConfig, as diffusers' PeftAdapterMixin keeps it; absent (AttributeError, as
        after diffusers' unload) while no adapter is loaded."""
        if not self.lora_state.configs:
            raise AttributeError("peft_config: no LoRA adapter is loaded")
        return self.lora_state.configs

    @property
    def _hf_peft_config_loaded(self) -> bool:
        return bool(self.lora_state.configs)

    def _lora_changed(self):
        self.lora_state.version += 1

    def _lora_layers(self) -> list[LoraLinear]:
        return [m for m in self.modules() if isinstance(m, LoraLinear)]

    def _lora_host(self, stock_name: str, create: bool = True) -> tuple[LoraLinear, torch.device] | None:
        """The LoraLinear holding the site of a stock module name (created on first use), and its linear's device;
        ValueError if no linear of this model has that name (create=False: only that check)."""
        name, part = site_of(stock_name, self.lora_sites)
        try:
            module = self.get_submodule(name)
        except AttributeError:
            module = None
        if not isinstance(module, (FastLinear, nn.Linear)):
            raise ValueError(f"the LoRA targets {stock_name!r}, which is not a linear layer of {self.stock_model_name} "
                             f"(config: {dict(num_layers=self.config.num_layers)})")
        if not create:
            return None
        lora = getattr(module, "lora", None)  # FastLinear: None until then; a plain nn.Linear: no such attribute
        if lora is None:
            if part is None:
                sites = {stock_name: (0, module.out_features)}
            else:  # every stock module of this fused linear, in the order of its rows
                block, linear = ".".join(name.split(".")[:2]), name.split(".")[2]  # transformer_blocks.{i}, qkv
                inner = sorted((p, s) for s, (lin, p) in self.lora_sites.items() if lin == linear)
                n = module.out_features // len(inner)
                sites = {f"{block}.{s}": (p * n, (p + 1) * n) for p, s in inner}
            lora = LoraLinear(sites, module.in_features, self.lora_state)
            if isinstance(module, FastLinear):
                module.lora = lora
            else:
                self._replace_unshared(name, LoraTargetLinear.wrap(module, lora))
        return lora, next(module.parameters()).device

    def _replace_unshared(self, name: str, new: nn.Module):
        """Put `new` at `name` without touching modules the stock model may share (from_diffusers shares the
        embedders, img_mod / txt_mod, norm_out, proj_out): each container on the path is replaced by a shallow copy
        with its own child table."""
        *path, leaf = name.split(".")
        parent = self
        for part in path:
            child = parent._modules[part]
            if not isinstance(child, (self.block_class, nn.ModuleList)):
                copy = object.__new__(type(child))
                copy.__dict__ = {**child.__dict__, "_modules": dict(child._modules)}
                parent._modules[part] = copy
                child = copy
            parent = child
        parent._modules[leaf] = new

    def load_lora_adapter(self, pretrained_model_name_or_path_or_dict, prefix="transformer", hotswap: bool = False,
                          **kwargs):
        """diffusers' PeftAdapterMixin.load_lora_adapter: the same arguments, file formats and config inference
        (diffusers' own _fetch_state_dict and _create_lora_config); the adapter becomes the active one."""
        from diffusers.loaders.lora_base import _fetch_state_dict
        from diffusers.utils import convert_unet_state_dict_to_peft
        from diffusers.utils.peft_utils import _create_lora_config
        from peft.utils.other import get_pattern_key

        if hotswap:
            raise NotImplementedError("hotswap=True: " + HOTSWAP_ADVICE)
        adapter_name = kwargs.pop("adapter_name", None)
        network_alphas = kwargs.pop("network_alphas", None)
        metadata = kwargs.pop("metadata", None)
        pipeline = kwargs.pop("_pipeline", None)
        kwargs.pop("low_cpu_mem_usage", None)  # factors are small: always loaded as given
        fetch = {k: kwargs.pop(k, None) for k in ("cache_dir", "proxies", "local_files_only", "token", "revision",
                                                    "subfolder", "weight_name", "use_safetensors")}
        fetch["force_download"] = kwargs.pop("force_download", False)
        if kwargs:
            raise TypeError(f"load_lora_adapter got unexpected arguments {sorted(kwargs)}")
        state_dict, metadata = _fetch_state_dict(pretrained_model_name_or_path_or_dict=pretrained_model_name_or_path_or_dict,
                                                 user_agent={"file_type": "attn_procs_weights", "framework": "pytorch"},
                                                 allow_pickle=False, metadata=metadata, **fetch)
        if network_alphas is not None and prefix is None:
            raise ValueError("`network_alphas` cannot be None when `prefix` is None.")
        if prefix is not None:
            state_dict = {k.removeprefix(f"{prefix}."): v for k, v in state_dict.items() if k.startswith(f"{prefix}.")}
            if metadata is not None:
                metadata = {k.removeprefix(f"{prefix}."): v for k, v in metadata.items() if k.startswith(f"{prefix}.")}
            if network_alphas:
                network_alphas = {k.removeprefix(f"{prefix}."): v for k, v in network_alphas.items()
                                  if k.startswith(f"{prefix}.")}
        if not state_dict:
            stock_logger.warning(f"No LoRA keys associated to {type(self).__name__} found with the prefix={prefix!r}: "
                           "nothing was loaded (as diffusers does); pass prefix=None for keys without it")
            return
        if adapter_name in self.lora_state.configs:
            raise ValueError(f"Adapter name {adapter_name} already in use in the model - please select a new adapter "
                             "name.")
        adapter_name = adapter_name or f"default_{len(self.lora_state.configs)}"
        if any(".lokr_" in k for k in state_dict):
            raise NotImplementedError("LoKr adapters are not supported on the fast transformer; " + BASELINE_ADVICE)
        if "lora_A" not in next(iter(state_dict)):
            state_dict = convert_unet_state_dict_to_peft(state_dict)
        rank = {f"^{k}": v.shape[1] for k, v in state_dict.items() if "lora_B" in k and v.ndim > 1}
        config = _create_lora_config(state_dict, network_alphas, metadata, rank, adapter_name=adapter_name)
        if config.use_dora or config.lora_bias:
            raise NotImplementedError(f"{'DoRA' if config.use_dora else 'LoRA bias'} adapters are not supported on "
                                      "the fast transformer; " + BASELINE_ADVICE)
        unknown = [k for k in state_dict if not (k.endswith(".lora_A.weight") or k.endswith(".lora_B.weight"))]
        if unknown:
            raise NotImplementedError(f"LoRA tensors {unknown[:3]} are not plain lora_A / lora_B weights; "
                                      + BASELINE_ADVICE)
        targets = sorted({k.rsplit(".lora_", 1)[0] for k in state_dict})
        for target in targets:  # every target checked before anything is added
            self._lora_host(target, create=False)
        # As diffusers' loader: accelerate's offload hooks come off for the injection and go back on after it
        model_offload, sequential_offload, _ = _func_optionally_disable_offloading(pipeline)
        hosts = [self._lora_host(t) for t in targets]
        for target, (lora, device) in zip(targets, hosts):
            a, b = state_dict[f"{target}.lora_A.weight"], state_dict[f"{target}.lora_B.weight"]
            r = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), target), config.r)
            alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), target), config.lora_alpha)
            base_scale = alpha / (r ** 0.5 if config.use_rslora else r)
            lora.add(target, adapter_name, a.to(device, self.dtype), b.to(device, self.dtype), base_scale)
        state = self.lora_state
        state.configs[adapter_name] = config
        state.weight[adapter_name], state.layer_scale[adapter_name] = 1.0, 1.0
        state.active = [adapter_name]  # peft activates the adapter it just injected, on every layer
        self._lora_changed()
        if model_offload:
            pipeline.enable_model_cpu_offload()
        elif sequential_offload:
            pipeline.enable_sequential_cpu_offload()
        _maybe_remove_and_reapply_group_offloading(self)  # group offload's groups must take in the new factors

    def _check_adapters(self, names: list[str]):
        missing = [n for n in names if n not in self.lora_state.configs]
        if missing:
            raise ValueError(f"Adapter name(s) {missing} not in the list of present adapters: "
                             f"{set(self.lora_state.configs)}.")

    def set_adapters(self, adapter_names, weights=None):
        """Activate these adapters with these weights (None: 1.0), as diffusers' set_adapters."""
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        weights = weights if isinstance(weights, list) else [weights] * len(names)
        if len(names) != len(weights):
            raise ValueError(f"Length of adapter names {len(names)} is not equal to the length of their weights "
                             f"{len(weights)}.")
        if any(isinstance(w, dict) for w in weights):
            raise NotImplementedError("per-block adapter weights (dicts) are not supported on the fast transformer; "
                                      "pass one float per adapter")
        self._check_adapters(names)
        state = self.lora_state
        fused = self.fused_adapters
        rescaled = [name for name, w in zip(names, weights) if name in fused
                    and (1.0 if w is None else float(w)) != state.weight[name] * state.layer_scale[name]]
        if rescaled:  # peft would unmerge them at the new scaling, leaving the difference in the weights
            raise ValueError(f"set_adapters would change the scaling of the fused adapter(s) {rescaled}: "
                             "unfuse_lora() first, then set_adapters (and fuse_lora again if wanted)")
        state.active = names
        for name, w in zip(names, weights):
            state.weight[name], state.layer_scale[name] = 1.0 if w is None else float(w), 1.0
        self._lora_changed()

    def set_adapter(self, adapter_name):
        names = [adapter_name] if isinstance(adapter_name, str) else list(adapter_name)
        self._check_adapters(names)
        self.lora_state.active = names
        self._lora_changed()

    def active_adapters(self) -> list[str]:
        if not self.lora_state.configs:
            raise ValueError("No adapter loaded. Please load an adapter first.")
        return list(self.lora_state.active)

    def _set_enabled(self, enabled: bool):
        self.lora_state.enabled = enabled
        if not enabled:  # peft unfuses a disabled layer (at its next forward; nothing runs in between here)
            self._unfreeze_all()
        self._lora_changed()

    def disable_lora(self):
        self._set_enabled(False)

    def enable_lora(self):
        self._set_enabled(True)

    disable_adapters, enable_adapters = disable_lora, enable_lora

    def fuse_lora(self, lora_scale=1.0, safe_fusing=False, adapter_names=None):
        """peft's merge per layer: the active adapters (or adapter_names) at their scaling times lora_scale (which,
        as in peft, stays on their scaling) are frozen into the layers; see lora.py. While disabled nothing stays
        fused: peft merges, and the disabled layer's next forward unmerges."""
        names = list(self.lora_state.active) if adapter_names is None else list(adapter_names)
        self._check_adapters(names)
        if lora_scale != 1.0:
            for name in self.lora_state.active:
                self.lora_state.layer_scale[name] *= lora_scale
        if not self.lora_state.enabled:
            self._lora_changed()
            return
        if names and set(names) <= self.fused_adapters:
            logger.warning("All adapters are already merged, nothing to do.")  # peft's words
        for lora in self._lora_layers():
            lora.freeze(names, safe_fusing)
        # Folded into FP8 weights unless offload hooks hold their own copies of the weights (group offload with
        # streams onloads from pinned host copies, which a fold would not reach): then kept low-rank, still exact.
        if not has_offload_hooks(self):
            fallback = []  # (linear, why)
            for name, module in self.named_modules():
                if isinstance(module, FastLinear) and module.lora is not None:
                    module.fold_lora(master=functools.partial(self._master, name, module, fallback))
            if fallback:
                logger.warning(f"fuse_lora: {len(fallback)} FP8 linears were requantized from their dequantized FP8 "
                               f"weights, a second e4m3 rounding ({fallback[0][0]}: {fallback[0][1]}); fusing on "
                               "the stock pipeline before optimize(), or loading the upstream checkpoint with "
                               "QwenImageFastPipeline.from_pretrained, quantizes the merged weights once")
        self._lora_changed()

    def _master(self, name: str, linear: FastLinear, fallback: list) -> torch.Tensor | None:
        """The BF16 weight the FP8 linear `name` was quantized from, read from weight_source ([N, K], the stock
        q / k / v weights stacked for a qkv linear), if it quantizes to that FP8 weight bit-exactly; else None,
        recorded in `fallback`."""
        why = "no checkpoint folder is known (the stock model was not loaded from one)"
        if self.weight_source is not None and name.startswith("transformer_blocks."):
            i, fast_name = name.split(".")[1:]
            stock = [n for n, (linear_name, _) in sorted(self.lora_sites.items(), key=lambda kv: kv[1][1] or 0)
                     if linear_name == fast_name]
            device = linear.weight_q.device
            try:
                master = torch.cat([self.weight_source.get(f"transformer_blocks.{i}.{n}.weight", device)
                                    for n in stock])
            except (OSError, KeyError) as e:
                why = f"{self.weight_source.folder} cannot be read ({type(e).__name__}: {e})"
            else:
                q, s = quantize_fp8_rowwise_ref(master)
                if torch.equal(q.view(torch.uint8), linear.weight_q.view(torch.uint8)) and \
                        torch.equal(s.view(-1), linear.weight_scale):
                    return master
                why = f"its weight in {self.weight_source.folder} no longer quantizes to the model's"
        fallback.append((name, why))
        return None

    def unfuse_lora(self):
        self._unfreeze_all()
        self._lora_changed()

    def _unfreeze_all(self):
        folded = [m for m in self.modules() if isinstance(m, FastLinear) and m.lora is not None and m.lora.folded]
        if folded and has_offload_hooks(self):
            raise RuntimeError("the fused LoRA adapters are folded into the FP8 weights, and offload hooks were added "
                               "since, which may hold their own copies of the weights: remove the offloading "
                               "(e.g. pipe.remove_all_hooks()), unfuse, then enable it again")
        for module in folded:
            module.unfold_lora()
        for lora in self._lora_layers():
            lora.unfreeze()

    @property
    def fused_adapters(self) -> set[str]:
        return {a for lora in self._lora_layers() for frozen in lora.frozen.values() for a, _ in frozen}

    def delete_adapters(self, adapter_names):
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        fused = set(names) & self.fused_adapters
        if fused:
            raise ValueError(f"adapter(s) {sorted(fused)} are fused: unfuse_lora() first, then delete them")
        state = self.lora_state
        if not [a for a in state.active if a not in names]:  # peft then activates, per layer, its first remaining one
            remaining = [a for a in state.configs if a not in names]
            for lora in self._lora_layers():
                for site, by_adapter in lora.factors.items():
                    present = [a for a in by_adapter if a not in names]
                    if present and present[0] != remaining[0]:
                        raise NotImplementedError(
                            f"delete_adapters({names}) leaves no active adapter: peft would activate the first "
                            f"remaining one of each layer, {present[0]!r} at {site} but {remaining[0]!r} elsewhere; "
                            "the fast transformer keeps one active set: set_adapters(...) to the ones wanted first")
        for name in names:
            for lora in self._lora_layers():
                lora.delete(name)
            for table in (state.configs, state.weight, state.layer_scale):
                table.pop(name, None)
            if name in state.active:  # as peft: the other active ones stay, else the first remaining adapter
                state.active = [a for a in state.active if a != name] or list(state.configs)[:1]
        self._drop_empty_lora_layers()
        self._lora_changed()
        _maybe_remove_and_reapply_group_offloading(self)

    def unload_lora(self):
        """Remove every adapter: fused ones stay in effect, as diffusers' unload keeps merged weights; unfused
        ones are gone (the base weights are untouched, so unfusing first restores the model exactly)."""
        fused = self.fused_adapters
        if fused:
            raise NotImplementedError(
                f"adapter(s) {sorted(fused)} are fused, and unloading would have to bake them into the weights, which "
                "the fast transformer does not do (an FP8 weight would be requantized): call unfuse_lora() before "
                "unloading, or keep them loaded")
        state = self.lora_state
        for lora in self._lora_layers():
            for name in list(lora.adapters):
                lora.delete(name)
        state.configs.clear(), state.weight.clear(), state.layer_scale.clear()
        state.active, state.enabled = [], True
        self._drop_empty_lora_layers()
        self._lora_changed()
        _maybe_remove_and_reapply_group_offloading(self)

    def _drop_empty_lora_layers(self):
        for name, module in list(self.named_modules()):
            if isinstance(module, FastLinear) and module.lora is not None and not module.lora.adapters:
                module.lora = None
            elif isinstance(module, LoraTargetLinear) and not module.lora.adapters:
                self._replace_unshared(name, module.original[0])
