"""The kernel implementations of `attnres_torch.dispatch`, one module each: `triton_depth`
("triton": support check, `@triton.jit` kernels, host code, custom-op bodies; importing it
imports Triton), `cpu_c` ("cpu_c": the fused C kernel, its source in `csrc/depth_cpu.c`, built at
first use), `chunked` ("chunked": the chunked torch kernel, the fallback without a C compiler and
for sources strided along D) and `composite` ("composite": the plain differentiable torch
composition: float64, heads, sigmoid, no key norm, the merge with gradients).  Importing this
package imports none of them."""
