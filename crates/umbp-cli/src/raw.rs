//! A bare gRPC connection to a running server, with no session: what `umbp ping|stats|clear`,
//! `umbp stats --watch` and the benchmarks' private servers speak.

use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use tonic::transport::Channel;
use umbp_core::ErrorKind;
use umbp_proto::errors;
use umbp_proto::v1::{self, store_client::StoreClient};
use umbp_proto::Endpoint;

/// A bare gRPC connection to the server (no session).
#[derive(Debug)]
pub struct Raw {
    rt: tokio::runtime::Runtime,
    grpc: StoreClient<Channel>,
    pub(crate) endpoint: Endpoint,
    timeout: Duration,
}

impl Raw {
    /// A connection to `endpoint` (made lazily); every call waits up to `timeout`.
    pub fn new(endpoint: Endpoint, timeout: Duration) -> Result<Self> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("cannot start a Tokio runtime")?;
        let channel = {
            let _g = rt.enter();
            umbp_client::unix_channel(&endpoint)
        };
        let grpc = StoreClient::new(channel)
            .max_decoding_message_size(umbp_proto::DEFAULT_MAX_MESSAGE_BYTES)
            .max_encoding_message_size(umbp_proto::DEFAULT_MAX_MESSAGE_BYTES);
        Ok(Raw {
            rt,
            grpc,
            endpoint,
            timeout,
        })
    }

    fn call<T, F, Fut>(&self, what: &str, f: F) -> Result<T>
    where
        F: FnOnce(StoreClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let fut = f(self.grpc.clone());
        let ep = &self.endpoint;
        match self
            .rt
            .block_on(async { tokio::time::timeout(self.timeout, fut).await })
        {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(s)) => Err(match errors::kind_of_status(&s) {
                ErrorKind::Unavailable | ErrorKind::SessionLost => {
                    let why = if !ep.path().exists() {
                        format!("there is no socket at {}", ep.path().display())
                    } else {
                        s.message().to_string()
                    };
                    anyhow!(
                        "cannot reach the UMBP server at {ep}: {why}; start it (umbp_standalone_server --address {ep}) or point --endpoint / UMBP_STANDALONE_ADDRESS at the socket it listens on"
                    )
                }
                ErrorKind::Denied => anyhow!("the UMBP server at {ep} refused {what}: {}", s.message()),
                k => anyhow!("the UMBP server at {ep} refused {what}: {} ({k})", s.message()),
            }),
            Err(_) => Err(anyhow!(
                "the UMBP server at {ep} did not answer {what} within {} ms; it may be overloaded or stopped (SIGSTOP), or raise --timeout-ms",
                self.timeout.as_millis()
            )),
        }
    }

    /// Boot id, version and uptime.
    pub fn ping(&self) -> Result<v1::PingReply> {
        self.call(
            "ping",
            |mut g| async move { g.ping(v1::PingRequest {}).await },
        )
    }

    /// Every counter of the pool and the server.
    pub fn stats(&self) -> Result<v1::StatsReply> {
        self.call("stats", |mut g| async move {
            g.stats(v1::StatsRequest {}).await
        })
    }

    /// The live pins by key namespace.
    pub fn pins(&self) -> Result<v1::PinsReply> {
        self.call(
            "pins",
            |mut g| async move { g.pins(v1::PinsRequest {}).await },
        )
    }

    /// Removes every object, or those of one namespace; returns how many.
    pub fn clear(&self, namespace: Option<&str>) -> Result<u64> {
        let namespace = namespace.unwrap_or_default().to_string();
        Ok(self
            .call("clear", |mut g| async move {
                g.clear(v1::ClearRequest { namespace }).await
            })?
            .removed)
    }
}
