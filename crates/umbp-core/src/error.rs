use thiserror::Error;

use crate::ErrorKind;

/// Errors raised while building keys, layouts or configuration.
///
/// Every variant that a user can cause names the option or value to change.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum CoreError {
    /// A configuration option has a value that cannot be used.
    #[error("invalid option `{option}`: {message}")]
    InvalidOption {
        /// The option's name as the user spells it.
        option: String,
        /// What is wrong and what to change.
        message: String,
    },
    /// A standalone endpoint is not an absolute Unix socket path ([`crate::address`]).
    #[error(
        "endpoint {given:?}: {why}; give an absolute socket path such as \
         /run/umbp/node.grpc.sock or unix:///run/umbp/node.grpc.sock"
    )]
    InvalidEndpoint {
        /// What was given.
        given: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// An option that no mode knows (a typo, or an option of another product).
    #[error("unknown option `{option}` in kv_connector_extra_config; known options: {known}")]
    UnknownOption {
        /// The name given.
        option: String,
        /// The options of the mode, sorted, comma-separated.
        known: String,
    },
    /// A KV layout description is inconsistent.
    #[error("invalid KV layout: {0}")]
    InvalidLayout(String),
    /// A KV cache tensor view cannot be turned into copy runs.
    #[error("KV cache tensor `{tensor}` cannot be planned: {message}")]
    TensorLayout {
        /// The tensor's (layer's) name.
        tensor: String,
        /// Why, and what to change.
        message: String,
    },
    /// A block id is outside the layout's blocks.
    #[error("block id {block_id} is out of range: the layout has {num_blocks} blocks")]
    BlockOutOfRange {
        /// The offending block id.
        block_id: u64,
        /// Blocks the layout describes.
        num_blocks: u64,
    },
    /// A block hash is empty or longer than a key can hold.
    #[error("block hash of {len} bytes cannot be keyed: hashes must be 1..=32 bytes")]
    InvalidHash {
        /// The hash length given.
        len: usize,
    },
}

impl CoreError {
    /// The error's kind: always [`ErrorKind::InvalidArgument`] (the input is what to change).
    pub fn kind(&self) -> ErrorKind {
        ErrorKind::InvalidArgument
    }

    /// Shorthand for [`CoreError::InvalidOption`].
    pub fn option(option: impl Into<String>, message: impl Into<String>) -> Self {
        CoreError::InvalidOption {
            option: option.into(),
            message: message.into(),
        }
    }
}
