// A prompt chunk's (token, expert) pairs grouped by expert on the device (part of the "ops" module), for the tiled
// expert matmuls of a layer whose experts are all resident: the host reads no routing back and waits for nothing.
//
// Shape legend: T tokens, K experts a token, P = T * K pairs (pair p = t * K + j), E experts, TT rows a work tile,
// W work tiles (a bound: ceil(P / TT) + min(E, P)).

// ids int32 [P] and slot_map int32 [E] (-1: not resident) -> order int32 [P] (the pair of each row: each resident
// expert's pairs in pair order, experts in id order, as hybrid/pair_groups' host grouping; rows past the resident
// pairs take pair 0), row_of_pair int32 [P] (-1: not resident) and tiles int32 [3, W]: per work tile its expert's
// slot, first row and rows (at most TT; tiles past the last have none). One block; a thread an expert in the
// row pass, which reads the ids a run of blockDim at a time from shared memory. Dynamic shared 4 * (3 E + blockDim).
extern "C" __global__ void prompt_groups(const int* ids, const int* slot_map, int P, int E, int TT, int W,
                                         int* order, int* row_of_pair, int* tiles) {
    extern __shared__ int sp[];
    int* count = sp;                // [E] resident pairs of each expert
    int* next = count + E;          // [E] each expert's next row (its first until the row pass)
    int* first_tile = next + E;     // [E]
    int* stage = first_tile + E;    // [blockDim] a run of the ids
    __shared__ int totals[2];       // rows, tiles
    for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < P; p += blockDim.x) {
        int e = ids[p];
        if (slot_map[e] >= 0) atomicAdd(&count[e], 1);
        else row_of_pair[p] = -1;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
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
    for (int p0 = 0; p0 < P; p0 += blockDim.x) {
        int n = min((int)blockDim.x, P - p0);
        __syncthreads();  // the last run's reads are done (and, the first time, the tiles' reads of next)
        if (threadIdx.x < n) stage[threadIdx.x] = ids[p0 + threadIdx.x];
        __syncthreads();
        for (int e = threadIdx.x; e < E; e += blockDim.x) {
            if (count[e] == 0) continue;
            int row = next[e];
            for (int q = 0; q < n; ++q) {
                if (stage[q] != e) continue;
                order[row] = p0 + q;
                row_of_pair[p0 + q] = row;
                ++row;
            }
            next[e] = row;
        }
    }
}
