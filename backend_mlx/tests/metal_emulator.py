"""A CPU stand-in for `mx.fast.metal_kernel` that compiles the kernel *body* as C++ and runs it
with 32 real threads per threadgroup (one per SIMD lane, `simd_sum` through a barrier).

It checks the logic of `attnres_mlx/kernels/metal.py` on Linux: indexing, thread layout,
formulas, the Python wrappers' shapes.  It cannot check Metal syntax, Metal's math library or
half/bfloat16 arithmetic: inputs are widened to float32 (exact) and `T(...)` outputs are rounded
to their dtype afterwards.  Every output buffer starts as NaN, so an unwritten element shows.

Build: the driver (threads, barrier, file I/O) is compiled once per session; each kernel body is
a small translation unit (only <cmath>) linked against it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from collections import Counter

import mlx.core as mx
import numpy as np

BODY_PRELUDE = r"""
#include <cmath>
#include <algorithm>
using std::exp; using std::log; using std::max; using std::sqrt;
typedef unsigned uint;
struct uint3 { uint x, y, z; };
#define device
#define constant
using T = float;
static inline float rsqrt(float x) { return 1.0f / sqrt(x); }
float simd_sum(float v);
"""

DRIVER = r"""
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>
using namespace std;
typedef unsigned uint;
struct uint3 { uint x, y, z; };
void kernel_entry(const void** in, float** out, uint3 tg, uint lane);
extern const int NUM_IN, NUM_OUT;
static float g_lanes[32];
static barrier<>* g_barrier;
static thread_local uint g_lane;
// simd_sum over the 32 lanes: publish, wait, sum in lane order (a fixed order), wait.
float simd_sum(float v) {
  g_lanes[g_lane] = v;
  g_barrier->arrive_and_wait();
  float s = 0.0f;
  for (int i = 0; i < 32; ++i) s += g_lanes[i];
  g_barrier->arrive_and_wait();
  return s;
}
static vector<char> read_file(const char* path) {
  FILE* f = fopen(path, "rb"); fseek(f, 0, SEEK_END); long n = ftell(f); fseek(f, 0, SEEK_SET);
  vector<char> b(n); if (n) { size_t r = fread(b.data(), 1, n, f); (void)r; } fclose(f); return b;
}
int main(int argc, char** argv) {
  // argv: dir, groups, then one output size (elements) per output.
  const char* dir = argv[1];
  const uint groups = atoi(argv[2]);
  vector<vector<char>> in;
  vector<const void*> in_ptr;
  for (int i = 0; i < NUM_IN; ++i) {
    char p[4096]; snprintf(p, sizeof p, "%s/in%d.bin", dir, i); in.push_back(read_file(p));
  }
  for (auto& b : in) in_ptr.push_back(b.data());
  vector<vector<float>> out;
  vector<float*> out_ptr;
  for (int j = 0; j < NUM_OUT; ++j) out.emplace_back(atol(argv[3 + j]), NAN);
  for (auto& b : out) out_ptr.push_back(b.data());
  for (uint tg = 0; tg < groups; ++tg) {
    barrier<> bar(32);
    g_barrier = &bar;
    vector<thread> lanes;
    for (uint l = 0; l < 32; ++l) lanes.emplace_back([&, l] {
      g_lane = l;
      kernel_entry(in_ptr.data(), out_ptr.data(), uint3{tg, 0, 0}, l);
    });
    for (auto& t : lanes) t.join();
  }
  for (int j = 0; j < NUM_OUT; ++j) {
    char p[4096]; snprintf(p, sizeof p, "%s/out%d.bin", dir, j);
    FILE* f = fopen(p, "wb"); fwrite(out[j].data(), 4, out[j].size(), f); fclose(f);
  }
}
"""


def _gxx(*args):
    subprocess.run(["g++", "-std=c++20", "-O0", "-pthread", *args], check=True,
                   capture_output=True)


class Emulator:
    """`mx.fast.metal_kernel` replacement; `calls` counts launches by kernel name."""

    def __init__(self, workdir: str):
        self.workdir = workdir
        self.calls: Counter = Counter()
        self.driver = os.path.join(workdir, "driver.o")
        if not os.path.exists(self.driver):
            with open(self.driver + ".cpp", "w") as f:
                f.write(DRIVER)
            _gxx("-c", "-o", self.driver, self.driver + ".cpp")

    def metal_kernel(self, *, name, input_names, output_names, source, **_):
        return _Kernel(self, name, list(input_names), list(output_names), source)


class _Kernel:
    def __init__(self, emu, name, input_names, output_names, source):
        self.emu, self.name = emu, name
        self.input_names, self.output_names, self.source = input_names, output_names, source

    def _binary(self, int_inputs):
        types = ["uint" if i in int_inputs else "float" for i in range(len(self.input_names))]
        params = [f"const {t}* {n}" for t, n in zip(types, self.input_names)]
        params += [f"float* {n}" for n in self.output_names]
        params += ["uint3 threadgroup_position_in_grid", "uint thread_index_in_simdgroup"]
        args = [f"(const {t}*)in[{i}]" for i, t in enumerate(types)]
        args += [f"out[{j}]" for j in range(len(self.output_names))]
        code = (BODY_PRELUDE
                + f"extern const int NUM_IN = {len(types)}, NUM_OUT = {len(self.output_names)};\n"
                + f"static void body({', '.join(params)}) {{\n{self.source}\n}}\n"
                + "void kernel_entry(const void** in, float** out, uint3 tg, uint lane) {\n"
                + f"  body({', '.join(args)}, tg, lane);\n}}\n")
        exe = os.path.join(self.emu.workdir, "k" + hashlib.sha1(code.encode()).hexdigest()[:16])
        if not os.path.exists(exe):
            with open(exe + ".cpp", "w") as f:
                f.write(code)
            _gxx("-o", exe, exe + ".cpp", self.emu.driver)
        return exe

    def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes,
                 init_value=None, **_):
        assert threadgroup == (32, 1, 1) and grid[0] % 32 == 0 and grid[1:] == (1, 1)
        self.emu.calls[self.name] += 1
        int_inputs = {i for i, a in enumerate(inputs) if a.dtype == mx.uint32}
        exe = self._binary(int_inputs)
        run_dir = tempfile.mkdtemp(dir=self.emu.workdir)
        for i, a in enumerate(inputs):
            host = np.array(a if i in int_inputs else a.astype(mx.float32))
            host.astype(np.uint32 if i in int_inputs else np.float32).tofile(
                os.path.join(run_dir, f"in{i}.bin"))
        sizes = [str(int(np.prod(s))) for s in output_shapes]
        subprocess.run([exe, run_dir, str(grid[0] // 32), *sizes], check=True)
        return [mx.array(np.fromfile(os.path.join(run_dir, f"out{j}.bin"), dtype=np.float32)
                         .reshape(shape)).astype(dtype)
                for j, (shape, dtype) in enumerate(zip(output_shapes, output_dtypes))]
