//! token-stream: see the crate README. (Skeleton; the implementation lands with its issue.)
