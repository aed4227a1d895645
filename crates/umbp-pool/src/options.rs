//! The pool's caching options beyond [`umbp_core::PoolConfig`]'s: how many keys `on_reuse`
//! remembers. The policy and admission types live in umbp-core (they are connector options).

pub use umbp_core::caching::{EvictionPolicy, StoreAdmission, DEFAULT_ADMISSION_WINDOW};

use umbp_core::PoolConfig;

/// Caching options of a [`crate::Pool`] ([`crate::Pool::with_options`]); the default is what
/// [`crate::Pool::new`] uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolOptions {
    /// Eviction policy.
    pub eviction_policy: EvictionPolicy,
    /// Which commits are stored.
    pub store_admission: StoreAdmission,
    /// How many distinct keys `on_reuse` remembers as seen once (oldest forgotten first): a
    /// key reused after more other keys than this were seen is skipped again.
    pub admission_window: usize,
}

impl PoolOptions {
    /// The options `cfg` sets (its `eviction_policy` and `store_admission`), with the default
    /// admission window: what [`crate::Pool::new`] uses.
    pub fn of(cfg: &PoolConfig) -> Self {
        PoolOptions {
            eviction_policy: cfg.eviction_policy,
            store_admission: cfg.store_admission,
            admission_window: DEFAULT_ADMISSION_WINDOW,
        }
    }
}

impl Default for PoolOptions {
    /// The options of a default [`PoolConfig`].
    fn default() -> Self {
        PoolOptions::of(&PoolConfig::default())
    }
}
