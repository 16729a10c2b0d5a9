// A prompt chunk's (token, expert) pairs grouped by expert on the device (part of the "ops" module), for the tiled
// expert matmuls of a layer whose experts are all resident: the host reads no routing back and waits for nothing.
//
// Shape legend: T tokens, K experts a token (distinct: top-k routing), P = T * K pairs (pair p = t * K + j),
// E experts, TT rows a work tile, W work tiles (a bound: ceil(P / TT) + min(E, P)), TR tokens a round (a multiple of
// 32), NW = TR / 32 words of a round's token bits.

// ids int32 [T, K] and slot_map int32 [E] (-1: not resident) -> order int32 [P] (the pair of each row: each resident
// expert's pairs in pair order, experts in id order, as hybrid/pair_groups' host grouping; rows past the resident
// pairs take pair 0), row_of_pair int32 [P] (-1: not resident) and tiles int32 [3, W]: per work tile its expert's
// slot, first row and rows (at most TT; tiles past the last have none). One block. A pair's row is its expert's
// first row, plus the pairs of that expert in earlier rounds, plus the earlier tokens of its round that route that
// expert: each round of TR tokens sets a bit per (expert, token) and counts the bits below. Dynamic shared
// 4 * (3 E + E NW) bytes.
extern "C" __global__ void prompt_groups(const int* ids, const int* slot_map, int T, int K, int E, int TT, int W,
                                         int TR, int* order, int* row_of_pair, int* tiles) {
    extern __shared__ int sp[];
    int* count = sp;                              // [E] resident pairs of each expert
    int* next = count + E;                        // [E] each expert's next row
    int* first_tile = next + E;                   // [E]
    unsigned* seen = (unsigned*)(first_tile + E); // [E, NW] the tokens of this round that route each expert
    __shared__ int totals[2];                     // rows, tiles
    int P = T * K, NW = TR / 32;
    for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < P; p += blockDim.x) {
        int e = ids[p];
        if (slot_map[e] >= 0) atomicAdd(&count[e], 1);
        else row_of_pair[p] = -1;
    }
    __syncthreads();
    if (E <= (int)blockDim.x) {  // inclusive scans of the rows and tiles (Hillis-Steele), then made exclusive
        int e = threadIdx.x, c = e < E ? count[e] : 0;
        int rows = c, num_tiles = (c + TT - 1) / TT;
        for (int d = 1; d < E; d *= 2) {
            __syncthreads();
            if (e < E) {
                next[e] = rows;
                first_tile[e] = num_tiles;
            }
            __syncthreads();
            if (e < E && e >= d) {
                rows += next[e - d];
                num_tiles += first_tile[e - d];
            }
        }
        __syncthreads();
        if (e < E) {
            next[e] = rows - c;
            first_tile[e] = num_tiles - (c + TT - 1) / TT;
            if (e == E - 1) {
                totals[0] = rows;
                totals[1] = num_tiles;
            }
        }
    } else if (threadIdx.x == 0) {
        int rows = 0, num_tiles = 0;
        for (int e = 0; e < E; ++e) {
            next[e] = rows;
            first_tile[e] = num_tiles;
            rows += count[e];
            num_tiles += (count[e] + TT - 1) / TT;
        }
        totals[0] = rows;
        totals[1] = num_tiles;
    }
    __syncthreads();
    int* tile_slot = tiles;
    int* tile_row = tiles + W;
    int* tile_count = tiles + 2 * W;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        for (int i = 0; i * TT < count[e]; ++i) {
            int w = first_tile[e] + i;
            tile_slot[w] = slot_map[e];
            tile_row[w] = next[e] + i * TT;
            tile_count[w] = min(TT, count[e] - i * TT);
        }
    }
    for (int w = totals[1] + threadIdx.x; w < W; w += blockDim.x) {
        tile_slot[w] = 0;
        tile_row[w] = 0;
        tile_count[w] = 0;
    }
    for (int r = totals[0] + threadIdx.x; r < P; r += blockDim.x) order[r] = 0;
    for (int t0 = 0; t0 < T; t0 += TR) {
        int n = min(TR, T - t0) * K;  // pairs this round
        __syncthreads();  // the last round's counts are taken
        for (int i = threadIdx.x; i < E * NW; i += blockDim.x) seen[i] = 0u;
        __syncthreads();
        for (int q = threadIdx.x; q < n; q += blockDim.x) {
            int e = ids[t0 * K + q], t = q / K;
            if (slot_map[e] >= 0) atomicOr(&seen[e * NW + t / 32], 1u << (t % 32));
        }
        __syncthreads();
        for (int q = threadIdx.x; q < n; q += blockDim.x) {
            int p = t0 * K + q, e = ids[p], t = q / K;
            if (slot_map[e] < 0) continue;
            const unsigned* s = seen + e * NW;
            int row = next[e] + __popc(s[t / 32] & ((1u << (t % 32)) - 1u));
            for (int w = 0; w < t / 32; ++w) row += __popc(s[w]);
            order[row] = p;
            row_of_pair[p] = row;
        }
        __syncthreads();
        for (int e = threadIdx.x; e < E; e += blockDim.x) {
            int c = 0;
            for (int w = 0; w < NW; ++w) c += __popc(seen[e * NW + w]);
            next[e] += c;
        }
    }
}
