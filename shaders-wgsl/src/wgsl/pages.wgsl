
// Paged rows (device KV pages, the engine's `backend::wgpu::pagedev`): row `w` of a session's row table lives at
// row `page_row(w)` of the layer's page pool: `(ptab[w >> page_shift] << page_shift) | (w & (2^page_shift - 1))`.
// Appended to a kernel that declares `ptab: array<u32>` (the session's page table) and a `page_shift` member of
// its uniform `p`. A table `[0]` with `page_shift` 31 addresses an unpaged buffer (row w at w).
fn page_row(w: u32) -> u32 {
    let mask = (1u << p.page_shift) - 1u;
    return (ptab[w >> p.page_shift] << p.page_shift) | (w & mask);
}
