//! placeholder
pub mod host_share;
