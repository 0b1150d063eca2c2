"""Storage codecs by name: the one route to a codec is the `quant=<codec>` config group (a codec under any
method); `method=<codec>` is shorthand for `method=full quant=<codec>` (`resolve_storage`).

    build_codec("kivi", model, bits=2, group_size=32, residual=128, key_axis="channel")
    build_codec("kvquant", model, bits=3, outlier_fraction=0.01, levels="nuq", calibration="fisher")
    build_codec("none", model)  -> None (full precision: the engine keeps its plain PagedKVCache)

Options set to None take their defaults (YAML null). Unknown names, unknown options and invalid values raise
UserError with one line naming the choices.
"""
from __future__ import annotations

from typing import Any

from kvbench.errors import UserError
from kvbench.registry import Registry

CODEC_NAMES = ("none", "full", "kivi", "kvquant", "int8", "fp8")
# the codecs' defaults, declared once here (conf/quant/<codec>.yaml shows the same values; a test keeps them equal)

KIVI_DEFAULTS = dict(bits=2, group_size=32, residual=128, key_axis="channel")
KVQUANT_DEFAULTS = dict(bits=3, outlier_fraction=0.01, levels="nuq", calibration="fisher", key_ranges="calibrated",
                        calibration_corpus="aclsum_train", calibration_sequences=4, calibration_tokens=1024,
                        tokenizer=None, cache_dir=None)
OPTIONS: dict[str, dict[str, Any]] = {"none": {}, "full": {}, "kivi": KIVI_DEFAULTS, "kvquant": KVQUANT_DEFAULTS,
                                      "int8": {}, "fp8": {}}


def available_codecs() -> list[str]:
    return list(CODEC_NAMES)


def resolve_storage(method_name: str, method_options: dict[str, Any], quant_name: Any,
                    quant_options: dict[str, Any]) -> tuple[str, dict[str, Any], str, dict[str, Any]]:
    """The one route to a codec: `method=<codec>` becomes `method=full quant=<codec>` (the method's options are
    the codec's). A method and a quant that both name a codec is an error, never a silent winner.
    Returns (method_name, method_options, quant_name, quant_options); codec options are checked here."""
    quant_name = "none" if quant_name in (None, "full") else quant_name
    if not isinstance(quant_name, str) or quant_name not in CODEC_NAMES:
        from kvbench.registry import unknown_choice

        raise unknown_choice("quant", quant_name, [c for c in CODEC_NAMES if c != "full"])
    if method_name in CODEC_NAMES and method_name not in ("none", "full"):
        if quant_name != "none":
            raise UserError(f"method={method_name} and quant={quant_name} both choose a storage codec: use "
                            f"method=full quant={quant_name}, or method=<eviction method> quant={quant_name}")
        method_name, quant_name, quant_options, method_options = "full", method_name, dict(method_options), {}
    _options(quant_name, dict(quant_options))  # unknown options -> UserError
    return method_name, method_options, quant_name, dict(quant_options)


def check_codec(name: str, options: dict[str, Any], shape: Any = None) -> None:
    """Validate a codec's options without building it (no model, no calibration): UserError on a bad value.
    `shape` (kvbench.model_info.ModelShape, or None when unknown) bounds KIVI's group_size and kvquant's
    calibration_tokens by the model's positions."""
    opts = _options(name, options)
    for key, default in OPTIONS[name].items():  # an integer option takes an integer (3.0 is normalised to 3 before)
        value = opts[key]
        if isinstance(default, int) and not isinstance(default, bool) and \
                (isinstance(value, bool) or not isinstance(value, int)):
            raise UserError(f"invalid quant.{key}={value!r}: expected an integer")
    try:
        limit = getattr(shape, "max_positions", None)
        if name == "kivi":
            _kivi(opts)
            if limit and opts["group_size"] > limit:
                raise UserError(f"invalid quant.group_size={opts['group_size']}: expected at most the model's "
                                f"{limit} positions (a longer group never fills)")
        elif name == "kvquant":
            settings = kvquant_settings(opts)
            if settings.needs_activations and limit and settings.seq_len > limit:
                raise UserError(f"invalid quant.calibration_tokens={settings.seq_len}: expected at most the "
                                f"model's {limit} positions")
    except (TypeError, ValueError) as exc:
        raise UserError(f"invalid settings for quant {name!r}: {exc}") from None


def storage_geometry(name: str, options: dict[str, Any]) -> tuple[int, Any]:
    """(block_size_hint, fp_block_dtype) of codec `name` with `options`, without building it: blocks hold a
    multiple of the hint (kvbench.runtime.caches.codec_block_size); fp_block_dtype is the torch dtype of its
    full-precision blocks (None: the model's). (1, None) for full precision."""
    if name in ("none", "full"):
        return 1, None
    from kvbench.quant import codecs

    cls = {"kivi": codecs.KiviCodec, "kvquant": codecs.KVQuantCodec, "int8": codecs.Int8Codec,
           "fp8": codecs.Fp8Codec}[name]
    hint = _options(name, options)["group_size"] if name == "kivi" else cls.block_size_hint
    return int(hint), getattr(cls, "fp_block_dtype", None)


def _kivi(opts: dict[str, Any]):
    from kvbench.quant.codecs import KiviCodec

    if opts["bits"] not in (2, 4, 8):
        raise ValueError(f"bits={opts['bits']!r}: choices are 2, 4, 8")
    return KiviCodec(bits=opts["bits"], group_size=opts["group_size"], residual=opts["residual"],
                     key_axis=opts["key_axis"])


def _options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    defaults = OPTIONS[name]
    bad = sorted(set(options) - set(defaults))
    if bad:
        valid = ", ".join(sorted(defaults)) or "(none)"
        raise UserError(f"unknown option quant.{bad[0]} for codec {name!r}; valid options are {valid}")
    return {k: (defaults[k] if options.get(k) is None else options[k]) for k in defaults}


def build_codec(name: str, model: Any = None, **options: Any):
    """The storage codec `name` with `options`, or None for full precision (none / full).

    `model` (a LlamaFamilyModel) is needed by codecs that calibrate on it (kvquant with nuq levels or calibrated
    key thresholds)."""
    builder = CODECS.get(name)
    opts = _options(name, options)
    try:
        return builder(model, opts)
    except (TypeError, ValueError) as exc:
        raise UserError(f"invalid settings for quant {name!r}: {exc}") from None


CODECS: Registry = Registry("quant")


@CODECS.register("none")
def _none(model: Any, opts: dict[str, Any]) -> None:
    return None


CODECS.register("full")(lambda model, opts: None)


@CODECS.register("int8")
def _int8(model: Any, opts: dict[str, Any]):
    from kvbench.quant.codecs import Int8Codec

    return Int8Codec()


@CODECS.register("fp8")
def _fp8(model: Any, opts: dict[str, Any]):
    from kvbench.quant.codecs import Fp8Codec

    return Fp8Codec()


CODECS.register("kivi")(lambda model, opts: _kivi(opts))
CODECS.register("kvquant")(lambda model, opts: _build_kvquant(model, opts))


def kvquant_settings(opts: dict[str, Any]):
    """CalibrationSettings from kvquant options (validated: UserError on a bad value)."""
    from kvbench.quant.calibration import CalibrationSettings

    return CalibrationSettings(
        bits=opts["bits"], outlier_fraction=float(opts["outlier_fraction"]), levels=opts["levels"],
        method=opts["calibration"], key_ranges=opts["key_ranges"], corpus=opts["calibration_corpus"],
        num_sequences=opts["calibration_sequences"], seq_len=opts["calibration_tokens"],
    )


def _build_kvquant(model: Any, opts: dict[str, Any]):
    from kvbench.quant.calibration import calibrate
    from kvbench.quant.codecs import KVQuantCodec as codec_cls

    settings = kvquant_settings(opts)
    if settings.needs_activations and model is None:
        raise UserError("codec 'kvquant' calibrates on the model: pass the model to build_codec")
    cal = calibrate(model, opts["tokenizer"], settings, cache_dir=opts["cache_dir"])
    codec = codec_cls(bits=settings.bits, outlier_fraction=settings.outlier_fraction, levels=settings.levels,
                      key_levels=cal.key_levels, value_levels=cal.value_levels, key_ranges=cal.key_ranges)
    codec.calibration = settings.method  # "none" for uniform levels
    codec.calibration_corpus = settings.corpus if settings.needs_activations else "none"
    codec.calibration_info = cal.info
    return codec
