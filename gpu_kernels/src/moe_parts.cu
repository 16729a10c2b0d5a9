// A bias added to every row (the q/k/v projections' biases; part of the "ops" module).
//
// Shape legend: R row width, n values.

// x [n / R, R] += bias [R] elementwise. grid (ceil(n / blockDim)).
extern "C" __global__ void add_bias(float* x, const float* bias, i64 n, int R) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += bias[i % R];
}
