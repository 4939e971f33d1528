//! CPU kernels over quantized weights in place (matrix-vector and matrix-matrix products).
