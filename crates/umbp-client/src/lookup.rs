//! Lookups: which keys the pool holds, on this rank or across ranks, and failing fast while
//! an earlier lookup is stalled.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use umbp_core::{BlockKey, PinOutcome, RankTopology};
use umbp_proto::v1;

use crate::client::StandaloneClient;
use crate::error::{ClientError, Result};
use crate::rpc::status_error;

impl StandaloneClient {
    /// Which of `keys` are in the pool (one key per block; a single rank).
    pub fn exists(&self, keys: &[BlockKey]) -> Result<Vec<bool>> {
        let r = self.lookup(packed_request(keys, 1, false))?;
        Ok(r.present.iter().map(|p| *p != 0).collect())
    }

    /// How many of `keys`, from the first, are in the pool.
    pub fn prefix_hits(&self, keys: &[BlockKey]) -> Result<usize> {
        Ok(self.lookup(packed_request(keys, 1, true))?.prefix as usize)
    }

    /// Per block, whether every rank of `ranks` holds it, with keys built in the server from
    /// `namespace`, `group` and the packed `hashes` (`hash_bytes` each). Returns the per-block
    /// answer (empty with `prefix_only`) and the number of leading blocks every rank holds.
    /// Every block reported held is leased for the load that follows (the server's
    /// `--lookup-lease-ms`).
    pub fn exists_across_ranks(
        &self,
        namespace: &str,
        ranks: &[RankTopology],
        group: u32,
        hashes: &[u8],
        hash_bytes: u32,
        prefix_only: bool,
    ) -> Result<(Vec<bool>, usize)> {
        let mut req = ranks_request(namespace, ranks, group, hashes, hash_bytes);
        req.prefix_only = prefix_only;
        let r = self.lookup(req)?;
        Ok((
            r.present.iter().map(|p| *p != 0).collect(),
            r.prefix as usize,
        ))
    }

    /// Per block, whether every rank of `ranks` has it in the server's DRAM pool now, as
    /// [`exists_across_ranks`](Self::exists_across_ranks) but leasing nothing, reading no
    /// lower tier and counting no hit or miss: for watching which stored blocks were evicted
    /// (the connector's `BlockRemoved` events), never for a lookup a load follows.
    pub fn holds_across_ranks(
        &self,
        namespace: &str,
        ranks: &[RankTopology],
        group: u32,
        hashes: &[u8],
        hash_bytes: u32,
    ) -> Result<Vec<bool>> {
        let mut req = ranks_request(namespace, ranks, group, hashes, hash_bytes);
        req.peek = true;
        let r = self.lookup(req)?;
        Ok(r.present.iter().map(|p| *p != 0).collect())
    }

    /// Pins `keys` (one rank's) in the server's pool for `ttl` (1 ms to 24 h): never evicted
    /// while pinned, whichever engine stored them; pinning a pinned block renews it. Pins are
    /// bounded in bytes per namespace (the server's `--pin-namespace-bytes`) and outlive this
    /// client.
    pub fn pin(&self, keys: &[BlockKey], ttl: std::time::Duration) -> Result<Vec<PinOutcome>> {
        let r = self.pin_call(
            keys,
            u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX),
            false,
        )?;
        Ok(r.outcomes.into_iter().map(PinOutcome::from_code).collect())
    }

    /// Releases the pins of `keys`; how many were pinned.
    pub fn unpin(&self, keys: &[BlockKey]) -> Result<u64> {
        Ok(self.pin_call(keys, 0, true)?.released)
    }

    fn pin_call(&self, keys: &[BlockKey], ttl_ms: u64, unpin: bool) -> Result<v1::PinReply> {
        let blocks = packed_request(keys, 1, false);
        self.call("pin", self.inner.opts.control_timeout, |mut g| async move {
            g.pin(v1::PinRequest {
                blocks: Some(blocks),
                ttl_ms,
                unpin,
            })
            .await
        })
    }

    fn lookup(&self, req: v1::ExistsRequest) -> Result<v1::ExistsReply> {
        self.check()?;
        if self.inner.stalled_lookups.load(Ordering::Acquire) > 0 {
            return Err(ClientError::Stalled { what: "lookup" });
        }
        let timeout = self.inner.opts.lookup_timeout;
        let mut g = self.inner.grpc.clone();
        let handle = self.inner.rt().spawn(async move { g.exists(req).await });
        let stalled = Arc::clone(&self.inner.stalled_lookups);
        let r = self.inner.rt().block_on(async move {
            let mut handle = handle;
            match tokio::time::timeout(timeout, &mut handle).await {
                Ok(r) => Some(r),
                Err(_) => {
                    // Left running: later lookups fail at once until this one is answered.
                    stalled.fetch_add(1, Ordering::AcqRel);
                    tokio::spawn(async move {
                        let _ = handle.await;
                        stalled.fetch_sub(1, Ordering::AcqRel);
                    });
                    None
                }
            }
        });
        match r {
            None => Err(ClientError::Timeout {
                what: "lookup",
                ms: timeout.as_millis() as u64,
            }),
            Some(Err(e)) => Err(ClientError::Internal(format!("lookup task failed: {e}"))),
            Some(Ok(Ok(r))) => Ok(r.into_inner()),
            Some(Ok(Err(s))) => Err(status_error("exists", &self.inner.opts.endpoint, s)),
        }
    }
}

/// A request with keys built in the server: `namespace`, `group`, hashes, for every rank.
fn ranks_request(
    namespace: &str,
    ranks: &[RankTopology],
    group: u32,
    hashes: &[u8],
    hash_bytes: u32,
) -> v1::ExistsRequest {
    v1::ExistsRequest {
        keys: Some(v1::KeySet {
            packed: Vec::new(),
            namespace: namespace.into(),
            group,
            hash_bytes,
            hashes: hashes.to_vec(),
        }),
        ranks: ranks
            .iter()
            .map(|r| v1::Ranks {
                tp: r.tp.into(),
                pcp: r.pcp.into(),
                dcp: r.dcp.into(),
                pp: r.pp.into(),
            })
            .collect(),
        ..Default::default()
    }
}

fn packed_request(keys: &[BlockKey], ranks: u32, prefix_only: bool) -> v1::ExistsRequest {
    let mut packed = Vec::with_capacity(keys.len() * umbp_proto::KEY_BYTES);
    for k in keys {
        packed.extend_from_slice(k.as_bytes());
    }
    v1::ExistsRequest {
        keys: Some(v1::KeySet {
            packed,
            ..Default::default()
        }),
        ranks: Vec::new(),
        packed_ranks: ranks,
        prefix_only,
        peek: false,
    }
}
