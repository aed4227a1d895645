//! The ids a store hands out.

/// Identifies a registered layout.
pub type LayoutId = u32;

/// Identifies a session of a store (unique within the store).
pub type SessionId = u64;
