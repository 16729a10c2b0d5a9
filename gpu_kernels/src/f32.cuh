// F32: one weight per unit, 4 bytes.
#define UNIT_WEIGHTS 1
__device__ __forceinline__ void unit_dequant(const u8* row, i64 u, float* w) {
    w[0] = __uint_as_float(*(const u32*)(row + 4 * u));
}
