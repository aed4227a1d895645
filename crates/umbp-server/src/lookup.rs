//! The keys of an `Exists` request: checked against the server's limits before any is built,
//! then handed out one rank at a time.

use tonic::Status;
use umbp_core::{BlockKey, CoreError, KeyBuilder, RankTopology};
use umbp_proto::v1;

use crate::refusal::{invalid, unpack_keys};

/// The most blocks per rank one `Exists` request may name: 1,048,576 (a 16M-token prompt in
/// blocks of 16).
pub(crate) const MAX_LOOKUP_BLOCKS: usize = 1 << 20;
/// The most keys (blocks × ranks) one `Exists` request may make the server build and look up:
/// 4,194,304. Keys are built one rank at a time, so a request holds at most
/// [`MAX_LOOKUP_BLOCKS`] of them (64 MiB) at once.
pub(crate) const MAX_LOOKUP_KEYS: usize = 1 << 22;

/// The keys of an `Exists` request, checked against the limits before any is built, and then
/// handed out one rank at a time.
pub(crate) enum LookupKeys {
    /// Keys the client built, rank-major.
    Packed { keys: Vec<BlockKey>, n: usize },
    /// Block hashes the server turns into each rank's keys.
    Hashes {
        base: KeyBuilder,
        ranks: Vec<RankTopology>,
        group: u32,
        hashes: Vec<u8>,
        hash_len: usize,
    },
}

impl LookupKeys {
    pub(crate) fn parse(r: &mut v1::ExistsRequest) -> Result<Self, Status> {
        let ks = r.keys.as_mut().ok_or_else(|| invalid("keys are missing"))?;
        if !ks.packed.is_empty() {
            let keys = unpack_keys(&ks.packed, "keys.packed")?;
            let n_ranks = r.packed_ranks.max(1) as usize;
            if !keys.len().is_multiple_of(n_ranks) {
                return Err(invalid(format!(
                    "{} packed keys do not split into {n_ranks} ranks",
                    keys.len()
                )));
            }
            let n = keys.len() / n_ranks;
            check_lookup_size(n, n_ranks)?;
            return Ok(LookupKeys::Packed { keys, n });
        }
        let hash_len = ks.hash_bytes as usize;
        if ks.hashes.is_empty() {
            return Ok(LookupKeys::Packed {
                keys: Vec::new(),
                n: 0,
            });
        }
        if r.ranks.is_empty() {
            return Err(invalid(
                "hashes given without ranks; name at least one rank",
            ));
        }
        if hash_len == 0 || !ks.hashes.len().is_multiple_of(hash_len) {
            return Err(invalid(format!(
                "keys.hashes: {} bytes is not a whole number of hash_bytes = {hash_len} hashes",
                ks.hashes.len()
            )));
        }
        check_lookup_size(ks.hashes.len() / hash_len, r.ranks.len())?;
        let base = KeyBuilder::new(&ks.namespace, RankTopology::default())
            .map_err(|e| invalid(e.to_string()))?;
        // The builder refuses a hash length it cannot take: find out before the lookup runs.
        base.keys_packed(ks.group, &ks.hashes[..hash_len], hash_len)
            .map_err(|e| invalid(e.to_string()))?;
        Ok(LookupKeys::Hashes {
            base,
            ranks: r.ranks.iter().map(ranks).collect::<Result<_, _>>()?,
            group: ks.group,
            hashes: std::mem::take(&mut ks.hashes),
            hash_len,
        })
    }

    /// Blocks per rank.
    pub(crate) fn blocks(&self) -> usize {
        match self {
            LookupKeys::Packed { n, .. } => *n,
            LookupKeys::Hashes {
                hashes, hash_len, ..
            } => hashes.len() / hash_len,
        }
    }

    pub(crate) fn n_ranks(&self) -> usize {
        match self {
            LookupKeys::Packed { keys, n } => keys.len().checked_div(*n).unwrap_or(1),
            LookupKeys::Hashes { ranks, .. } => ranks.len(),
        }
    }

    /// Rank `i`'s keys, in block order.
    pub(crate) fn rank(&self, i: usize) -> Result<std::borrow::Cow<'_, [BlockKey]>, CoreError> {
        Ok(match self {
            LookupKeys::Packed { keys, n } => keys[i * n..(i + 1) * n].into(),
            LookupKeys::Hashes {
                base,
                ranks,
                group,
                hashes,
                hash_len,
            } => base
                .with_ranks(ranks[i])
                .keys_packed(*group, hashes, *hash_len)?
                .into(),
        })
    }
}

/// Refuses an `Exists` request over [`MAX_LOOKUP_BLOCKS`] or [`MAX_LOOKUP_KEYS`].
fn check_lookup_size(blocks: usize, ranks: usize) -> Result<(), Status> {
    if blocks > MAX_LOOKUP_BLOCKS {
        return Err(invalid(format!(
            "an Exists request of {blocks} blocks per rank is over the server's limit of \
             {MAX_LOOKUP_BLOCKS}; look the prefix up in parts of at most that many blocks"
        )));
    }
    match blocks.checked_mul(ranks) {
        Some(k) if k <= MAX_LOOKUP_KEYS => Ok(()),
        _ => Err(invalid(format!(
            "an Exists request of {blocks} blocks × {ranks} ranks is over the server's limit of \
             {MAX_LOOKUP_KEYS} keys; look the prefix up in parts, or for fewer ranks at once"
        ))),
    }
}

fn ranks(r: &v1::Ranks) -> Result<RankTopology, Status> {
    let f = |v: u32, n: &str| {
        u16::try_from(v)
            .map_err(|_| invalid(format!("ranks.{n} = {v} is out of range (at most 65535)")))
    };
    Ok(RankTopology {
        tp: f(r.tp, "tp")?,
        pcp: f(r.pcp, "pcp")?,
        dcp: f(r.dcp, "dcp")?,
        pp: f(r.pp, "pp")?,
    })
}
