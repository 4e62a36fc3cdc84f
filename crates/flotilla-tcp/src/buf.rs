//! Reusable receive buffers and byte views of `f32` slices.

use std::ops::Deref;
use std::sync::{Arc, Mutex};

#[cfg(not(target_endian = "little"))]
compile_error!(
    "flotilla-tcp sends f32 in native byte order and supports little-endian targets only"
);

/// Views an `f32` slice as its little-endian bytes (no copy).
pub(crate) fn f32_bytes(s: &[f32]) -> &[u8] {
    bytemuck::cast_slice(s)
}

/// Views a mutable `f32` slice as bytes (no copy). Any byte pattern is a valid f32.
pub(crate) fn f32_bytes_mut(s: &mut [f32]) -> &mut [u8] {
    bytemuck::cast_slice_mut(s)
}

/// A small free list of byte buffers so that the hot receive path does not allocate.
///
/// It keeps at most `keep` buffers of at most `max_capacity` bytes each: a buffer returned
/// beyond these, or grown past that size, is freed. What a pool holds when its frames are
/// done is thus bounded by `keep * max_capacity` and, once traffic has once had `keep`
/// frames in flight together, is that much whatever the frames' timing was (a pool that
/// kept every buffer it ever needed at once would hold as many as the busiest moment had).
pub(crate) struct BufPool {
    free: Mutex<Vec<Vec<u8>>>,
    keep: usize,
    max_capacity: usize,
}

impl BufPool {
    /// A pool retaining at most `keep` buffers of at most `max_capacity` bytes each.
    pub(crate) fn new(keep: usize, max_capacity: usize) -> Arc<Self> {
        Arc::new(Self {
            free: Mutex::new(Vec::new()),
            keep,
            max_capacity,
        })
    }

    /// An empty buffer, reused when possible.
    pub(crate) fn take(self: &Arc<Self>) -> PoolBuf {
        let v = self
            .free
            .lock()
            .map(|mut f| f.pop())
            .unwrap_or_default()
            .unwrap_or_default();
        PoolBuf {
            v,
            pool: Some(self.clone()),
        }
    }

    fn give(&self, mut v: Vec<u8>) {
        if v.capacity() == 0 || v.capacity() > self.max_capacity {
            return;
        }
        v.clear();
        if let Ok(mut f) = self.free.lock()
            && f.len() < self.keep
        {
            f.push(v);
        }
    }
}

/// A byte buffer that returns to its pool when dropped.
pub(crate) struct PoolBuf {
    v: Vec<u8>,
    pool: Option<Arc<BufPool>>,
}

impl PoolBuf {
    /// The underlying vector (to read into).
    pub(crate) fn vec_mut(&mut self) -> &mut Vec<u8> {
        &mut self.v
    }

    /// Detaches the vector from the pool.
    pub(crate) fn into_vec(mut self) -> Vec<u8> {
        self.pool = None;
        std::mem::take(&mut self.v)
    }
}

impl Deref for PoolBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.v
    }
}

impl Drop for PoolBuf {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            pool.give(std::mem::take(&mut self.v));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_reuses_buffers() {
        let pool = BufPool::new(2, 1024);
        let mut b = pool.take();
        b.vec_mut().extend_from_slice(&[1, 2, 3]);
        let ptr = b.as_ptr();
        drop(b);
        let b2 = pool.take();
        assert!(b2.is_empty());
        assert_eq!(b2.v.as_ptr(), ptr);
        assert!(b2.into_vec().capacity() >= 3);
    }

    /// Past `keep` buffers, or past `max_capacity` bytes, a returned buffer is freed.
    #[test]
    fn pool_keeps_what_it_is_told() {
        let pool = BufPool::new(2, 1024);
        let mut bufs: Vec<PoolBuf> = (0..4).map(|_| pool.take()).collect();
        for b in &mut bufs {
            b.vec_mut().resize(512, 1);
        }
        drop(bufs);
        assert_eq!(pool.free.lock().map(|f| f.len()).unwrap_or(0), 2);
        let mut big = pool.take();
        big.vec_mut().resize(4096, 1);
        drop(big);
        let kept = pool
            .free
            .lock()
            .map(|f| f.iter().map(Vec::capacity).max())
            .ok();
        assert_eq!(
            kept.flatten(),
            Some(512),
            "the grown buffer was freed, not kept"
        );
        assert_eq!(pool.free.lock().map(|f| f.len()).unwrap_or(0), 1);
    }

    #[test]
    fn byte_views() {
        let mut v = [1.0f32, -2.5];
        assert_eq!(f32_bytes(&v)[..4], 1.0f32.to_le_bytes());
        f32_bytes_mut(&mut v)[4..].copy_from_slice(&7.0f32.to_le_bytes());
        assert_eq!(v, [1.0, 7.0]);
    }
}
