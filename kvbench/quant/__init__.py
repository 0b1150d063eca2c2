"""KV-cache quantization: bit packing, uniform / non-uniform quantizers, and the storage codecs of the pool.

Pure tensor functions live in `packing`, `uniform` and `nonuniform`; `codecs` turns them into fixed-size packed
blocks. The optional Triton dequantizer (`triton_dequant`) is not imported here: triton stays a lazy dependency.
"""
from kvbench.quant.codecs import (Fp8Codec, FullPrecisionCodec, Int8Codec, KiviCodec, KVCodec,
                                  KVQuantCodec)
from kvbench.quant.nonuniform import (dense_normalized, fit_channel_ranges, fit_nuq_levels, nuq_dequantize,
                                      nuq_quantize, uniform_levels)
from kvbench.quant.packing import ByteLayout, pack_codes, packed_nbytes, unpack_codes
from kvbench.quant.uniform import (dequantize_asym, dequantize_fp8, dequantize_int8_sym, quantize_asym,
                                   quantize_fp8, quantize_int8_sym)

__all__ = [
    "KVCodec", "FullPrecisionCodec", "KiviCodec", "KVQuantCodec", "Int8Codec", "Fp8Codec",
    "fit_nuq_levels", "fit_channel_ranges", "uniform_levels", "nuq_quantize", "nuq_dequantize",
    "dense_normalized", "ByteLayout", "pack_codes", "unpack_codes", "packed_nbytes",
    "quantize_asym", "dequantize_asym", "quantize_int8_sym", "dequantize_int8_sym", "quantize_fp8",
    "dequantize_fp8",
]
