// The MLP's gated activation of one element, act(g) * u: what ops_gated_activation (ops.cu)
// writes for each element and gemv_gated (gemv.cu) for each row of its product, so that the
// two give the same numbers. Prepended to both sources by kvdb-kernels.
// act 0: GELU-tanh g / (1 + exp(-2v)), v = sqrt(2/pi) (g + 0.044715 g³);
// act 1: SiLU g / (1 + exp(-g)). The exponent is clamped as the CPU's fast_exp clamps it (so
// never inf); the division and the product are correctly rounded, in the CPU's order.
__device__ __forceinline__ float gate_activation(float g, float u, unsigned int act) {
    float e;
    if (act == 0) {
        const float inner = 0.7978846f * (g + 0.044715f * g * g * g);
        e = __expf(fminf(fmaxf(-2.0f * inner, -87.0f), 88.0f));
    } else {
        e = __expf(fminf(fmaxf(-g, -87.0f), 88.0f));
    }
    return __fmul_rn(__fdiv_rn(g, 1.0f + e), u);
}

