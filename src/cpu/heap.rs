//! Giving freed heap memory back to the system after a model load.

/// Returns heap memory already freed to the operating system where the allocator keeps it
/// (glibc's `malloc_trim`; a no-op elsewhere). Loading a model frees large temporary buffers
/// (each tensor is read, converted and packed in turn), and glibc keeps freed blocks below its
/// adaptive mmap threshold in the heap: without this, SmolLM2's sparse model stays about 30 MB
/// (a quarter of its weights) above what it holds. The loaders call it after the layers (before
/// the largest tensor, the embedding, is read) and at the end.
pub fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `malloc_trim` has no preconditions: it only hands free pages back to the system.
    unsafe {
        libc::malloc_trim(0);
    }
}
