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

// The same pair from the scales held in registers (s0, s1, s2: bytes 0..3, 4..7, 8..11); j at run time.
__device__ __forceinline__ void scale_min_k4_regs(u32 s0, u32 s1, u32 s2, int j, int* sc, int* m) {
    int shift = 8 * (j & 3);
    u32 a = (s0 >> shift) & 0xffu, b = (s1 >> shift) & 0xffu;
    if (j < 4) {
        *sc = a & 63;
        *m = b & 63;
    } else {
        u32 c = (s2 >> shift) & 0xffu;
        *sc = (c & 15) | ((a >> 6) << 4);
        *m = (c >> 4) | ((b >> 6) << 4);
    }
}
