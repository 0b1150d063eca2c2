"""Storage codecs by name: the one route to a codec is the `quant=<codec>` config group (a codec under any
method); `method=<codec>` is shorthand for `method=full quant=<codec>` (kvbench.run.spec.resolve_storage).

    build_codec("kivi", model, bits=2, group_size=32, residual=128, key_axis="channel")
    build_codec("kvquant", model, bits=3, outlier_fraction=0.01, levels="nuq", calibration="fisher")
    build_codec("nvfp4", model, tensor_amax=None, rotate="none")   /   build_codec("mxfp4", model, rotate="hadamard")
    build_codec("none", model)  -> None (full precision: the engine keeps its plain PagedKVCache)

Each codec is registered in kvbench.registry.CODECS with its options' defaults (declared once, here; conf/quant/
<codec>.yaml shows the same values, a test keeps them equal) and its builder. Options set to None take their
defaults (YAML null). Unknown names, unknown options and invalid values raise UserError with one line naming the
choices.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from kvbench.errors import UserError
from kvbench.quant.calibration import CalibrationSettings, calibrate
from kvbench.quant.codecs import Fp8Codec, Int8Codec, KiviCodec, KVQuantCodec
from kvbench.quant.fp4_codecs import Mxfp4Codec, Nvfp4Codec
from kvbench.quant.rotation import ROTATIONS, RotatedCodec, is_power_of_two
from kvbench.registry import CODECS
from kvbench.run.spec import FULL_PRECISION, check_codec_options


@dataclass
class Codec:
    """A registered storage codec: its options with their defaults, and its builder (model, options) -> codec
    (None: full precision). `block_size_hint` / `fp_block_dtype` come from the codec class (None: full precision)."""

    defaults: dict[str, Any]
    build: Callable[[Any, dict[str, Any]], Any]
    codec_cls: Any = None
    # options added after runs were stored: at these values they are left out of the run's hash (its id), so the
    # runs stored before the option existed keep their ids (kvbench.run.spec.hashable_config)
    unhashed_defaults: dict[str, Any] = field(default_factory=dict)
    name: str = field(default="", init=False)  # set by CODECS.register


KIVI_DEFAULTS = dict(bits=2, group_size=32, residual=128, key_axis="channel", rotate="none", rotate_seed=0)
NVFP4_DEFAULTS = dict(tensor_amax=None, rotate="none", rotate_seed=0)
MXFP4_DEFAULTS = dict(rotate="none", rotate_seed=0)
ROTATE_DEFAULTS = dict(rotate="none", rotate_seed=0)  # the rotation options of the codecs that take them
KVQUANT_DEFAULTS = dict(bits=3, outlier_fraction=0.01, levels="nuq", calibration="fisher", key_ranges="calibrated",
                        calibration_corpus="aclsum_train", calibration_sequences=4, calibration_tokens=1024,
                        tokenizer=None, cache_dir=None)


def check_codec(name: str, options: dict[str, Any], shape: Any = None) -> None:
    """Validate a codec's options without building it (no model, no calibration): UserError on a bad value.
    `shape` (kvbench.run.model_info.ModelShape, or None when unknown) bounds KIVI's group_size and kvquant's
    calibration_tokens by the model's positions."""
    opts = check_codec_options(name, options)
    for key, default in CODECS.get(name).defaults.items():  # an integer option takes an integer (3.0 -> 3 before)
        value = opts[key]
        if isinstance(default, int) and not isinstance(default, bool) and \
                (isinstance(value, bool) or not isinstance(value, int)):
            raise UserError(f"invalid quant.{key}={value!r}: expected an integer")
    try:
        limit = getattr(shape, "max_positions", None)
        if "rotate" in opts:
            _check_rotation(opts, getattr(shape, "head_dim", None), bool(getattr(shape, "latent", False)))
        if name == "kivi":
            _kivi(opts)
            if limit and opts["group_size"] > limit:
                raise UserError(f"invalid quant.group_size={opts['group_size']}: expected at most the model's "
                                f"{limit} positions (a longer group never fills)")
        elif name == "nvfp4":
            _nvfp4(opts)
        elif name == "kvquant":
            settings = kvquant_settings(opts)
            if settings.needs_activations and limit and settings.seq_len > limit:
                raise UserError(f"invalid quant.calibration_tokens={settings.seq_len}: expected at most the "
                                f"model's {limit} positions")
    except (TypeError, ValueError) as exc:
        raise UserError(f"invalid settings for quant {name!r}: {exc}") from None


def storage_geometry(name: str, options: dict[str, Any]) -> tuple[int, Any]:
    """(block_size_hint, fp_block_dtype) of codec `name` with `options`, without building it: blocks hold a
    multiple of the hint (kvbench.runtime.cache.caches.codec_block_size); fp_block_dtype is the torch dtype of its
    full-precision blocks (None: the model's). (1, None) for full precision."""
    if name in FULL_PRECISION:
        return 1, None
    cls = CODECS.get(name).codec_cls
    hint = check_codec_options(name, options)["group_size"] if name == "kivi" else cls.block_size_hint
    return int(hint), getattr(cls, "fp_block_dtype", None)


def _check_rotation(opts: dict[str, Any], head_dim: int | None = None, latent: bool = False) -> None:
    """UserError for an unknown quant.rotate, or hadamard on a model whose head_dim is not a power of two or whose
    cache holds MLA latent rows (no per-head keys to rotate)."""
    if opts["rotate"] not in ROTATIONS:
        raise UserError(f"invalid quant.rotate={opts['rotate']!r}: choices are {', '.join(ROTATIONS)}")
    if opts["rotate"] == "hadamard" and latent:
        raise UserError("invalid quant.rotate=hadamard: the model caches MLA latent rows, not per-head keys "
                        "(choices for this model: none)")
    if opts["rotate"] == "hadamard" and head_dim and not is_power_of_two(int(head_dim)):
        raise UserError(f"invalid quant.rotate=hadamard: the model's head_dim {head_dim} is not a power of two "
                        "(choices for this model: none)")


def _rotated(codec, opts: dict[str, Any]):
    """`codec`, wrapped in the Hadamard rotation when quant.rotate=hadamard."""
    _check_rotation(opts)
    return RotatedCodec(codec, seed=opts["rotate_seed"]) if opts["rotate"] == "hadamard" else codec


def _kivi(opts: dict[str, Any]) -> KiviCodec:
    if opts["bits"] not in (2, 4, 8):
        raise ValueError(f"bits={opts['bits']!r}: choices are 2, 4, 8")
    return KiviCodec(bits=opts["bits"], group_size=opts["group_size"], residual=opts["residual"],
                     key_axis=opts["key_axis"])


def _nvfp4(opts: dict[str, Any]) -> Nvfp4Codec:
    amax = opts["tensor_amax"]
    if amax is not None and (isinstance(amax, bool) or not isinstance(amax, (int, float)) or not 0 < amax < math.inf):
        raise ValueError(f"tensor_amax={amax!r}: expected a positive number or null (each block's own amax)")
    return Nvfp4Codec(tensor_amax=None if amax is None else float(amax))


def build_codec(name: str, model: Any = None, **options: Any):
    """The storage codec `name` with `options`, or None for full precision (none / full).

    `model` (a LlamaFamilyModel) is needed by codecs that calibrate on it (kvquant with nuq levels or calibrated
    key thresholds)."""
    codec = CODECS.get(name)
    opts = check_codec_options(name, options)
    try:
        return codec.build(model, opts)
    except (TypeError, ValueError) as exc:
        raise UserError(f"invalid settings for quant {name!r}: {exc}") from None


def kvquant_settings(opts: dict[str, Any]) -> CalibrationSettings:
    """CalibrationSettings from kvquant options (validated: UserError on a bad value)."""
    return CalibrationSettings(
        bits=opts["bits"], outlier_fraction=float(opts["outlier_fraction"]), levels=opts["levels"],
        method=opts["calibration"], key_ranges=opts["key_ranges"], corpus=opts["calibration_corpus"],
        num_sequences=opts["calibration_sequences"], seq_len=opts["calibration_tokens"],
    )


def _build_kvquant(model: Any, opts: dict[str, Any]) -> KVQuantCodec:
    settings = kvquant_settings(opts)
    if settings.needs_activations and model is None:
        raise UserError("codec 'kvquant' calibrates on the model: pass the model to build_codec")
    cal = calibrate(model, opts["tokenizer"], settings, cache_dir=opts["cache_dir"])
    codec = KVQuantCodec(bits=settings.bits, outlier_fraction=settings.outlier_fraction, levels=settings.levels,
                         key_levels=cal.key_levels, value_levels=cal.value_levels, key_ranges=cal.key_ranges)
    codec.calibration = settings.method  # "none" for uniform levels
    codec.calibration_corpus = settings.corpus if settings.needs_activations else "none"
    codec.calibration_info = cal.info
    return codec


def _full_precision(model: Any, opts: dict[str, Any]) -> None:
    return None


CODECS.register("none")(Codec({}, _full_precision))
CODECS.register("full")(Codec({}, _full_precision))
CODECS.register("kivi")(Codec(KIVI_DEFAULTS, lambda model, opts: _rotated(_kivi(opts), opts), KiviCodec,
                              unhashed_defaults=ROTATE_DEFAULTS))
CODECS.register("kvquant")(Codec(KVQUANT_DEFAULTS, _build_kvquant, KVQuantCodec))
CODECS.register("int8")(Codec({}, lambda model, opts: Int8Codec(), Int8Codec))
CODECS.register("fp8")(Codec({}, lambda model, opts: Fp8Codec(), Fp8Codec))
CODECS.register("nvfp4")(Codec(NVFP4_DEFAULTS, lambda model, opts: _rotated(_nvfp4(opts), opts), Nvfp4Codec))
CODECS.register("mxfp4")(Codec(MXFP4_DEFAULTS, lambda model, opts: _rotated(Mxfp4Codec(), opts), Mxfp4Codec))
# every codec's options and defaults by name (the view tests and docs read; the declarations are above)
OPTIONS: dict[str, dict[str, Any]] = {name: CODECS.get(name).defaults for name in CODECS.names()}
