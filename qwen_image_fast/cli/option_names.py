"""The command-line option of each registered optimization (optimizations.REGISTRY): what render's options are
called (parser.py builds them) and what its errors name (inputs.py)."""

# The registered optimizations (by name) whose option is not a plain switch or value: those have options of their
# own (what loading a single file did follows from the file --model names).
OWN_OPTIONS = {"memory": "--max-memory", "parallel": "--parallel", "enhance_prompt": "--enhance",
               "single_file": "--model", "dequantized": "--model", "requantized": "--model"}
# The registered optimizations given as a value (parser.VALUE_OPTIONS says how); the others are --no-<field> switches.
VALUE_FIELDS = frozenset({"attention", "fp8_attention", "scheduler", "cfg_fraction", "cache"})


def option_of(opt) -> str:
    """The command-line option of a registered optimization: one of its own, a value option, or --no-<field>."""
    if opt.name in OWN_OPTIONS:
        return OWN_OPTIONS[opt.name]
    flag = opt.field.replace("_", "-")
    return f"--{flag}" if opt.field in VALUE_FIELDS else f"--no-{flag}"
