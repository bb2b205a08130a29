"""The sampler of a call: the pipeline's scheduler itself ("euler", whatever class it is), or DPM-Solver++ 2M /
UniPC derived from its config when FastConfig.scheduler asks for them. Built at call time, so replacing
`pipe.scheduler` works as in the stock pipeline."""

import inspect
import math

import numpy as np
from diffusers import DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

from ..core.config import SCHEDULERS


# The step-distilled Lightning LoRAs' sampler (lightx2v's Qwen-Image-Lightning release, generate_with_diffusers.py):
# FlowMatch Euler with the dynamic shift pinned to exp(log 3) = 3 at every resolution; 4 or 8 steps, true_cfg_scale=1.
LIGHTNING_SCHEDULER_CONFIG = {
    "base_image_seq_len": 256, "base_shift": math.log(3), "max_image_seq_len": 8192, "max_shift": math.log(3),
    "num_train_timesteps": 1000, "shift": 1.0, "shift_terminal": None, "time_shift_type": "exponential",
    "use_dynamic_shifting": True, "invert_sigmas": False, "stochastic_sampling": False, "use_beta_sigmas": False,
    "use_exponential_sigmas": False, "use_karras_sigmas": False,
}


def lightning_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """The scheduler Lightning LoRAs were distilled for: pipe.scheduler = lightning_scheduler()."""
    return FlowMatchEulerDiscreteScheduler.from_config(LIGHTNING_SCHEDULER_CONFIG)


def scheduler_kwargs(cls, config) -> dict:
    """The entries of a scheduler config that `cls` accepts (Qwen's FlowMatch config has extra keys)."""
    accepted = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in config.items() if k in accepted}


def make_scheduler(name: str, base):
    """The sampler for `name`: `base` itself for "euler", else configured from `base`'s config."""
    if name == "euler":
        return base
    if name == "dpm++2m":
        return DPMSolverMultistepScheduler(**{
            **scheduler_kwargs(DPMSolverMultistepScheduler, base.config),
            "prediction_type": "flow_prediction", "use_flow_sigmas": True, "algorithm_type": "dpmsolver++",
            "solver_order": 2, "final_sigmas_type": "zero", "lower_order_final": True,
        })
    if name == "unipc":
        return UniPCMultistepScheduler(**{
            **scheduler_kwargs(UniPCMultistepScheduler, base.config),
            "prediction_type": "flow_prediction", "use_flow_sigmas": True,
        })
    raise ValueError(f"scheduler={name!r}; allowed: {', '.join(SCHEDULERS)}")


def dynamic_shift(scheduler_config, image_seq_len: int) -> float:
    """The stock pipeline's mu, from the pipeline's scheduler config with its defaults."""
    return calculate_shift(image_seq_len, scheduler_config.get("base_image_seq_len", 256),
                           scheduler_config.get("max_image_seq_len", 4096), scheduler_config.get("base_shift", 0.5),
                           scheduler_config.get("max_shift", 1.15))


def fewest_steps(scheduler) -> int:
    """The fewest steps a call may take with this scheduler: 2 with a shift_terminal (check_not_one_step), else 1."""
    return 2 if getattr(scheduler.config, "shift_terminal", None) else 1


def check_not_one_step(scheduler, num_inference_steps, sigmas=None):
    """ValueError for a call whose sigmas end at 1 with Qwen-Image's scheduler config (shift_terminal 0.02): it
    stretches 1 - sigma by its last value; the stock pipelines' sigmas linspace(1, 1/N, N) end at 1 when N = 1, so
    the stretch divides 0 by 0 and stock diffusers denoises with NaN, a black image. Ours refuses that call."""
    last = sigmas[-1] if sigmas is not None and len(sigmas) else 1 / num_inference_steps if num_inference_steps else 0
    if fewest_steps(scheduler) == 1 or last != 1:
        return
    shift_terminal = scheduler.config.shift_terminal
    raise ValueError(
        f"num_inference_steps={num_inference_steps}{'' if sigmas is None else f', sigmas={list(sigmas)}'}: "
        f"{type(scheduler).__name__}'s shift_terminal={shift_terminal} stretches 1 - sigma by its last value, 0 here "
        "(the last sigma is 1), so stock diffusers denoises with NaN and returns a black image; use 2 or more steps "
        "(a 1-step distilled sampler needs a scheduler without shift_terminal)")


def set_timesteps(sampler, name: str, num_inference_steps: int, sigmas, mu: float, device):
    """Timesteps as the stock pipeline sets them (sigmas linspace(1, 1/N, N) unless given, with mu); DPM-Solver++
    takes no sigmas (its set_timesteps has no such argument), so a custom ladder is refused there."""
    if name == "dpm++2m":
        if sigmas is not None:
            raise ValueError("sigmas is not supported with scheduler='dpm++2m' (DPMSolverMultistepScheduler "
                             "takes no sigmas); use 'euler' or 'unipc' for custom sigmas")
        sampler.set_timesteps(num_inference_steps, device=device, mu=mu)
        return sampler.timesteps, len(sampler.timesteps)
    sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps) if sigmas is None else sigmas
    return retrieve_timesteps(sampler, num_inference_steps, device, sigmas=sigmas, mu=mu)
