"""Pallas kernels (leaf package): each = reference + kernel + ops wrapper."""

from pallas_kernels.ops import (BACKENDS, paged_decode_attention, paged_prefill_attention,
                                quantized_matmul)
from pallas_kernels.quantized_tensor import QuantizedTensor, dequantize, pack_int4, quantize, unpack_int4
