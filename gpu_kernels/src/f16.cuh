// F16: one weight per unit, 2 bytes.
#define UNIT_WEIGHTS 1
__device__ __forceinline__ void unit_dequant(const u8* row, i64 u, float* w) {
    w[0] = half_to_float(*(const u16*)(row + 2 * u));
}
