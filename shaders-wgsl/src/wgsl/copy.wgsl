// Word copies and zero fills as kernels, so they stay inside the tick's compute pass (a copy command would end it).
// Composed by `copy_source()`: this part, then per segment i < COPY_SEGMENTS its bindings 1 + 2i (src<i>, read) and
// 2 + 2i (dst<i>, read_write) and `seg<i>`, then the entries `copy<m>` (m = 1 .. COPY_SEGMENTS), each running
// segments 0 .. m - 1. Segment i (`p.s[i]` = (n, src_off, dst_off, 0), in u32 words) copies
//   dst<i>[dst_off + j] = src<i>[src_off + j]   for j < n   (bits copied exactly);
// dispatch (ceil(max n / 64), 1, 1). The host batches only segments that are independent: no segment writes what
// another in the batch reads or writes.
// Entry `zero` (composed after dst0): dst0[s[0].z + j] = 0 for j < s[0].x.
struct Params {
    s: array<vec4<u32>, 8>,
}

@group(0) @binding(0) var<uniform> p: Params;
