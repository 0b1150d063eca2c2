"""Storage codecs by name: `build_codec(name, model, **options)`, the entry point for `method=<codec>` and for
the `quant=<codec>` config group (a codec under an eviction method).

    build_codec("kivi", model, bits=2, group_size=32, residual=128, key_axis="channel")
    build_codec("kvquant", model, bits=3, outlier_fraction=0.01, levels="nuq", calibration="fisher")
    build_codec("none", model)  -> None (full precision: the engine keeps its plain PagedKVCache)

Options set to None take their defaults (YAML null). Unknown names, unknown options and invalid values raise
UserError with one line naming the choices.
"""
from __future__ import annotations

from typing import Any

from kvbench.errors import UserError

CODEC_NAMES = ("none", "full", "kivi", "kvquant", "int8", "fp8")

KIVI_DEFAULTS = dict(bits=2, group_size=32, residual=128, key_axis="channel")
KVQUANT_DEFAULTS = dict(bits=3, outlier_fraction=0.01, levels="nuq", calibration="fisher", key_ranges="calibrated",
                        calibration_corpus="aclsum_train", calibration_sequences=4, calibration_tokens=1024,
                        tokenizer=None, cache_dir=None)
OPTIONS: dict[str, dict[str, Any]] = {"none": {}, "full": {}, "kivi": KIVI_DEFAULTS, "kvquant": KVQUANT_DEFAULTS,
                                      "int8": {}, "fp8": {}}


def available_codecs() -> list[str]:
    return list(CODEC_NAMES)


def _options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    defaults = OPTIONS[name]
    bad = sorted(set(options) - set(defaults))
    if bad:
        valid = ", ".join(sorted(defaults)) or "(none)"
        raise UserError(f"unknown option(s) {', '.join(bad)} for codec {name!r}; valid: {valid}")
    return {k: (defaults[k] if options.get(k) is None else options[k]) for k in defaults}


def build_codec(name: str, model: Any = None, **options: Any):
    """The storage codec `name` with `options`, or None for full precision (none / full).

    `model` (a LlamaFamilyModel) is needed by codecs that calibrate on it (kvquant with nuq levels or calibrated
    key thresholds)."""
    from kvbench.quant.codecs import Fp8Codec, Int8Codec, KiviCodec, KVQuantCodec

    if not isinstance(name, str) or name not in CODEC_NAMES:
        raise UserError(f"unknown codec {name!r}; choose one of: {', '.join(CODEC_NAMES)}")
    opts = _options(name, options)
    try:
        if name in ("none", "full"):
            return None
        if name == "int8":
            return Int8Codec()
        if name == "fp8":
            return Fp8Codec()
        if name == "kivi":
            if opts["bits"] not in (2, 4, 8):
                raise ValueError(f"bits={opts['bits']!r}: choices are 2, 4, 8")
            return KiviCodec(bits=opts["bits"], group_size=opts["group_size"], residual=opts["residual"],
                             key_axis=opts["key_axis"])
        return _build_kvquant(model, opts, KVQuantCodec)
    except (TypeError, ValueError) as exc:
        raise UserError(f"invalid settings for codec {name!r}: {exc}") from None


def kvquant_settings(opts: dict[str, Any]):
    """CalibrationSettings from kvquant options (validated: UserError on a bad value)."""
    from kvbench.quant.calibration import CalibrationSettings

    return CalibrationSettings(
        bits=opts["bits"], outlier_fraction=float(opts["outlier_fraction"]), levels=opts["levels"],
        method=opts["calibration"], key_ranges=opts["key_ranges"], corpus=opts["calibration_corpus"],
        num_sequences=opts["calibration_sequences"], seq_len=opts["calibration_tokens"],
    )


def _build_kvquant(model: Any, opts: dict[str, Any], codec_cls):
    from kvbench.quant.calibration import calibrate

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
