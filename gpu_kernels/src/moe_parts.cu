// A bias added to every row (the q/k/v projections' biases), and a decode step's pairs grouped by expert (part of
// the "ops" module).
//
// Shape legend: R row width, n values, P = T * K a decode step's pairs (pair p = t * K + j), TT rows a work tile.

// x [n / R, R] += bias [R] elementwise. grid (ceil(n / blockDim)).
extern "C" __global__ void add_bias(float* x, const float* bias, i64 n, int R) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += bias[i % R];
}

// A decode step's resident pairs grouped by expert slot, so that the tiled expert matmuls read each expert's rows
// once for all its pairs (up to TT a tile): ids [P] and slot_map [E] -> order [P] (the pair of each row: an
// expert's pairs side by side in pair order, experts in the order of their first pair; rows past the resident
// pairs take pair 0) and tiles int32 [4, P]: per work tile w (slot, first row, rows; tiles past the last have no
// rows) and per pair its row (-1: not resident), as decode_tiles writes them. One block of blockDim >= P threads,
// a pair a thread; shared: 4 * blockDim ints.
extern "C" __global__ void decode_groups(const int* ids, const int* slot_map, int P, int TT, int* order, int* tiles) {
    extern __shared__ int sg[];
    int* slot = sg;                   // [blockDim] each pair's slot (-1: not resident, or no pair)
    int* rows = slot + blockDim.x;    // [blockDim] a group's pairs, at its first pair (else 0)
    int* first_row = rows + blockDim.x;   // [blockDim] a group's first row, at its first pair
    int* first_tile = first_row + blockDim.x;  // [blockDim] a group's first tile, at its first pair
    int p = threadIdx.x;
    slot[p] = p < P ? slot_map[ids[p]] : -1;
    __syncthreads();
    int s = slot[p], lead = p, rank = 0, count = 0;
    if (s >= 0) {
        lead = -1;
        for (int q = 0; q < P; ++q) {
            if (slot[q] != s) continue;
            if (lead < 0) lead = q;
            rank += q < p;
            ++count;
        }
    }
    rows[p] = s >= 0 && lead == p ? count : 0;
    __syncthreads();
    int row0 = 0, tile0 = 0, total = 0;
    for (int q = 0; q < P; ++q) {
        int c = rows[q], t = (c + TT - 1) / TT;
        row0 += q < p ? c : 0;
        tile0 += q < p ? t : 0;
        total += t;
    }
    first_row[p] = row0;
    first_tile[p] = tile0;
    __syncthreads();
    if (p >= P) return;
    int* tile_slot = tiles;
    int* tile_row = tiles + P;
    int* tile_count = tiles + 2 * P;
    int* row_of_pair = tiles + 3 * P;
    int row = s >= 0 ? first_row[lead] + rank : -1;
    row_of_pair[p] = row;
    if (row >= 0) order[row] = p;
    if (s >= 0 && lead == p) {
        for (int i = 0; i * TT < count; ++i) {
            tile_slot[tile0 + i] = s;
            tile_row[tile0 + i] = row0 + i * TT;
            tile_count[tile0 + i] = min(TT, count - i * TT);
        }
    }
    int resident = 0;  // rows in use: every resident pair's
    for (int q = 0; q < P; ++q) resident += rows[q];
    if (p >= resident) order[p] = 0;
    if (p >= total) {
        tile_slot[p] = 0;
        tile_row[p] = 0;
        tile_count[p] = 0;
    }
}
