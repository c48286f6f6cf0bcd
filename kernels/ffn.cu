// The fast tier's FFN kernels: the sparse FFN restricted to a list of neurons held in device
// memory as neuron-major bundles (`[gate | up | down^T]`, or `[up | down^T]` ungated, each row
// `hidden` long), the same layout the CPU tier reads.
//
// Three launches per call, all deterministic (fixed summation orders, no atomics):
//   1. `gate_up_*`: one warp per listed neuron computes gate and up for every row, applies the
//      activation, the row's mask and the inline threshold rule, and writes h[k][row].
//   2. `down_*`: each thread owns one output column j of one chunk of the list and sums
//      h[k][row] * down_k[j] over the chunk in list order into partial[chunk][row][j].
//   3. `sum_chunks`: out[row][j] = sum over chunks, in chunk order.
//
// Compiled to PTX for compute_75 at build time (build.rs): the driver JIT-compiles it for any
// newer GPU. bf16 is converted by hand (a 16-bit shift), so no sm_80 instruction is needed.

#include <cuda_fp16.h>
#include <stdint.h>

namespace {

__device__ __forceinline__ float load(const float* p, size_t i) { return p[i]; }
__device__ __forceinline__ float load(const __half* p, size_t i) { return __half2float(p[i]); }
__device__ __forceinline__ float load(const uint16_t* p, size_t i) {
    return __uint_as_float(((uint32_t)p[i]) << 16);
}

// Activation codes, as `Activation` numbers them on the host (see src/cuda/mod.rs).
enum { RELU = 0, DRELU = 1, SILU = 2, GELU = 3, GELU_TANH = 4 };

__device__ __forceinline__ float act(int a, float v) {
    switch (a) {
        case RELU:
        case DRELU:
            return fmaxf(v, 0.0f);
        case SILU:
            return v / (1.0f + expf(-v));
        case GELU:
            return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
        default: {
            const float c = 0.7978846f;  // sqrt(2/pi)
            return 0.5f * v * (1.0f + tanhf(c * (v + 0.044715f * v * v * v)));
        }
    }
}

// h of one neuron for one row, with the inline rule (`has_rule`, threshold `t`) as the CPU tier
// applies it: for ReLU/dReLU the gate must pass (act(g) > t) before up counts; otherwise |h| > t.
__device__ __forceinline__ float contribution(int a, int gated, float g, float u, int has_rule,
                                              float t) {
    const bool exact = a == RELU || a == DRELU;
    if (gated) {
        if (has_rule && exact && !(act(a, g) > t)) return 0.0f;
        const float h = a == DRELU ? fmaxf(g, 0.0f) * fmaxf(u, 0.0f) : act(a, g) * u;
        if (has_rule && !exact && !(fabsf(h) > t)) return 0.0f;
        return h;
    }
    const float h = act(a, u);
    if (has_rule && (exact ? !(h > t) : !(fabsf(h) > t))) return 0.0f;
    return h;
}

template <typename T>
__device__ void gate_up(const T* w, uint64_t stride, int gated, int hidden, const float* x,
                        int rows, const uint32_t* list, int count, const uint8_t* mask,
                        const float* gate_bias, const float* up_bias, int activation,
                        int has_rule, float t, float* h) {
    const int warp = (int)((blockIdx.x * (uint64_t)blockDim.x + threadIdx.x) / 32);
    const int lane = threadIdx.x % 32;
    if (warp >= count) return;
    const uint32_t s = list[warp];
    const T* gate = w + (uint64_t)s * stride;
    const T* up = gate + (gated ? hidden : 0);
    for (int r = 0; r < rows; ++r) {
        const float* xr = x + (uint64_t)r * hidden;
        float g = 0.0f, u = 0.0f;
        for (int i = lane; i < hidden; i += 32) {
            const float xv = xr[i];
            if (gated) g += load(gate, i) * xv;
            u += load(up, i) * xv;
        }
        // Butterfly sums: every lane ends with the same total, in the same order every run.
        for (int o = 16; o > 0; o >>= 1) {
            g += __shfl_xor_sync(0xffffffffu, g, o);
            u += __shfl_xor_sync(0xffffffffu, u, o);
        }
        if (lane == 0) {
            float v = 0.0f;
            if (mask[(uint64_t)warp * rows + r]) {
                v = contribution(activation, gated, g + gate_bias[s], u + up_bias[s], has_rule,
                                 t);
            }
            h[(uint64_t)warp * rows + r] = v;
        }
    }
}

template <typename T>
__device__ void down(const T* w, uint64_t stride, uint64_t down_at, int hidden, int rows,
                     const uint32_t* list, int count, int chunk, const float* h,
                     float* partial) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    const int c = blockIdx.y;
    if (j >= hidden) return;
    const int k0 = c * chunk;
    const int k1 = min(count, k0 + chunk);
    for (int r = 0; r < rows; ++r) {
        float acc = 0.0f;
        for (int k = k0; k < k1; ++k) {
            const float hv = h[(uint64_t)k * rows + r];
            if (hv != 0.0f) acc += hv * load(w + (uint64_t)list[k] * stride + down_at, j);
        }
        partial[((uint64_t)c * rows + r) * hidden + j] = acc;
    }
}

}  // namespace

#define FFN_KERNELS(NAME, T)                                                                  \
    extern "C" __global__ void gate_up_##NAME(                                                \
        const T* w, uint64_t stride, int gated, int hidden, const float* x, int rows,        \
        const uint32_t* list, int count, const uint8_t* mask, const float* gate_bias,         \
        const float* up_bias, int activation, int has_rule, float t, float* h) {              \
        gate_up<T>(w, stride, gated, hidden, x, rows, list, count, mask, gate_bias, up_bias,  \
                   activation, has_rule, t, h);                                               \
    }                                                                                         \
    extern "C" __global__ void down_##NAME(const T* w, uint64_t stride, uint64_t down_at,     \
                                           int hidden, int rows, const uint32_t* list,       \
                                           int count, int chunk, const float* h,              \
                                           float* partial) {                                  \
        down<T>(w, stride, down_at, hidden, rows, list, count, chunk, h, partial);            \
    }

FFN_KERNELS(f32, float)
FFN_KERNELS(f16, __half)
FFN_KERNELS(bf16, uint16_t)

// out[row][j] = sum over chunks c (in order) of partial[c][row][j].
extern "C" __global__ void sum_chunks(const float* partial, int chunks, int rows, int hidden,
                                      float* out) {
    const uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x;
    const uint64_t n = (uint64_t)rows * hidden;
    if (i >= n) return;
    float acc = 0.0f;
    for (int c = 0; c < chunks; ++c) acc += partial[(uint64_t)c * n + i];
    out[i] = acc;
}
