//! How a client connects and how long it waits ([`ClientOptions`]).

use std::time::Duration;

use umbp_core::options;
use umbp_proto::Endpoint;

/// How a client connects and how long it waits.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// The server's socket.
    pub endpoint: Endpoint,
    /// How long [`StandaloneClient::connect`](crate::StandaloneClient::connect) waits for the
    /// server to answer.
    pub startup_timeout: Duration,
    /// Deadline of a lookup.
    pub lookup_timeout: Duration,
    /// Deadline of a transfer (sent to the server, which cancels it past that).
    pub transfer_timeout: Duration,
    /// Deadline of other calls (attach, registrations, stats, clear).
    pub control_timeout: Duration,
    /// Shown in the server's logs.
    pub client_name: String,
    /// Largest gRPC message sent or accepted.
    pub max_message_bytes: usize,
    /// Whether transfers are answered through a completion page (the server wakes the
    /// waiting caller from its copy worker) as well as by their replies. On by default; off
    /// only to measure what the page saves.
    pub completion_page: bool,
    /// Whether transfers are sent on a transfer channel (a socket the calling thread writes
    /// to and a server thread reads, no runtime on either end) rather than over gRPC. On by
    /// default; off only to measure what the channel saves.
    pub transfer_channel: bool,
}

impl ClientOptions {
    /// Defaults for `endpoint`: the connector options' `startup_timeout_ms`,
    /// `lookup_timeout_ms` and `timeout_ms` (transfers and other calls), completion page and
    /// transfer channel on.
    pub fn new(endpoint: Endpoint) -> Self {
        let option_ms = |spec: &options::OptionSpec| Duration::from_millis(spec.default_u64());
        ClientOptions {
            endpoint,
            startup_timeout: option_ms(&options::STARTUP_TIMEOUT_MS),
            lookup_timeout: option_ms(&options::LOOKUP_TIMEOUT_MS),
            transfer_timeout: option_ms(&options::TIMEOUT_MS),
            control_timeout: option_ms(&options::TIMEOUT_MS),
            client_name: format!("pid {}", std::process::id()),
            max_message_bytes: umbp_proto::DEFAULT_MAX_MESSAGE_BYTES,
            completion_page: true,
            transfer_channel: true,
        }
    }
}
