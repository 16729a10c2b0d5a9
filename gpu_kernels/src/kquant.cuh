// The packed 6-bit (scale, min) pair of sub-block j of a Q4_K / Q5_K super-block (12 bytes at s).
__device__ __forceinline__ void scale_min_k4(const u8* s, int j, int* sc, int* m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}
