//! Device KV pages on wgpu: the shared device layer's pages ([`crate::backend::device::pages`]) with wgpu buffers.

pub use crate::backend::device::pages::LOG_CHUNK_TOKENS;

use super::context::WgpuContext;

/// A layer's page pool on wgpu.
pub type PagePool = crate::backend::device::pages::PagePool<WgpuContext>;
/// A session's page table on wgpu.
pub type PageTable = crate::backend::device::pages::PageTable<WgpuContext>;

#[cfg(test)]
mod tests {
    use super::super::tests::ctx_with;
    use crate::backend::device::pages::tests as checks;

    /// Growth keeps ids valid; a shared table copies its partial page on the first append (after a share and after
    /// a truncate into a shared page) and never writes a page the other table reads; releasing returns every page.
    #[test]
    fn shared_pages_are_copied_on_write_and_released() {
        let Some(ctx) = ctx_with(None) else { return };
        checks::shared_pages_are_copied_on_write_and_released(&ctx);
    }

    /// A log ring allocates chunks at their first write, a shared ring copies a whole chunk on its first write into
    /// it (and only that one), the other ring still reads its own rows, a slot never written is an error, and
    /// releasing both returns every chunk.
    #[test]
    fn log_chunks_are_shared_and_copied_on_write() {
        let Some(ctx) = ctx_with(None) else { return };
        checks::log_chunks_are_shared_and_copied_on_write(&ctx);
    }

    /// Host pages carrying a store key are uploaded once and shared by every table of the same rows; a page
    /// written in place or freed loses its key.
    #[test]
    fn keyed_pages_are_uploaded_once() {
        let Some(ctx) = ctx_with(None) else { return };
        checks::keyed_pages_are_uploaded_once(&ctx);
    }

    /// A pool never grows past the storage binding limit: the append that would is an error naming it.
    #[test]
    fn a_full_pool_is_a_clear_error() {
        let Some(ctx) = ctx_with(Some(checks::FULL_POOL_BINDING)) else { return };
        checks::a_full_pool_is_a_clear_error(&ctx);
    }
}
