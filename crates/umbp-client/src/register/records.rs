//! What the client registered, as records it keeps to register again after a restart:
//! regions and layouts by client id, each with the server's id and the generation (see
//! [`crate::attach::state::AttachState`]) it was given in. Pure state: the calls to the
//! server are passed in, so that the records are tested without one.

use std::collections::BTreeMap;

use umbp_core::LayerSpec;
use umbp_proto::v1;

use crate::error::{ClientError, Result};
use crate::host_share::SharedHostMemory;

/// Where a registration's memory comes from (kept to register it again).
#[derive(Debug)]
pub(crate) enum Source {
    Host(SharedHostMemory),
    Cuda,
}

#[derive(Debug)]
pub(crate) struct RegionRecord {
    /// The client's range.
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) source: Source,
    /// (generation, server region id).
    pub(crate) server: Option<(u64, u64)>,
}

#[derive(Debug)]
pub(crate) struct LayoutRecord {
    pub(crate) groups: Vec<Vec<LayerSpec>>,
    pub(crate) object_bytes: Vec<u64>,
    /// (generation, server layout id).
    pub(crate) server: Option<(u64, u32)>,
}

/// Every region and layout of the client, by client id (ids are handed out in order and
/// never reused, and stay the same across re-attaches).
#[derive(Debug, Default)]
pub(crate) struct Records {
    next_region: u64,
    next_layout: u32,
    pub(crate) regions: BTreeMap<u64, RegionRecord>,
    pub(crate) layouts: BTreeMap<u32, LayoutRecord>,
}

impl Records {
    /// Refuses a range that overlaps a region this client registered. Two registrations of
    /// one address would leave layouts resolving to whichever was found first: with host
    /// memory freed while registered and allocated again at the same address, that is the
    /// old registration's memfd, which the process no longer maps there, so loads would
    /// land where the engine never reads them (as the embedded registry, it is refused).
    pub(crate) fn check_free(&self, addr: u64, len: u64) -> Result<()> {
        let end = addr.saturating_add(len);
        for (id, r) in &self.regions {
            if addr < r.addr.saturating_add(r.len) && r.addr < end {
                return Err(ClientError::Overlapping(format!(
                    "memory {addr:#x}+{len} overlaps region {id} ({:#x}+{}) this client \
                     registered; deregister that one first (memory freed while registered \
                     must be deregistered before it is registered again)",
                    r.addr, r.len
                )));
            }
        }
        Ok(())
    }

    /// Records a region the server registered as `server` (generation, server region id);
    /// returns its client id.
    pub(crate) fn add_region(
        &mut self,
        addr: u64,
        len: u64,
        source: Source,
        server: (u64, u64),
    ) -> u64 {
        let id = self.next_region;
        self.next_region += 1;
        self.regions.insert(
            id,
            RegionRecord {
                addr,
                len,
                source,
                server: Some(server),
            },
        );
        id
    }

    /// Forgets region `id` and every layout with a run in it; returns the region's
    /// (generation, server region id), if the server had it.
    pub(crate) fn remove_region(&mut self, id: u64) -> Result<Option<(u64, u64)>> {
        let r = self.regions.remove(&id).ok_or_else(|| {
            ClientError::Unregistered(format!(
                "memory region {id} is not registered by this client"
            ))
        })?;
        let (addr, end) = (r.addr, r.addr + r.len);
        self.layouts.retain(|_, l| {
            !l.groups
                .iter()
                .flatten()
                .any(|s| s.base_addr >= addr && s.base_addr < end)
        });
        Ok(r.server)
    }

    /// Records a layout the server registered as `server` (generation, server layout id);
    /// returns its client id.
    pub(crate) fn add_layout(
        &mut self,
        groups: Vec<Vec<LayerSpec>>,
        object_bytes: Vec<u64>,
        server: (u64, u32),
    ) -> u32 {
        let id = self.next_layout;
        self.next_layout += 1;
        self.layouts.insert(
            id,
            LayoutRecord {
                groups,
                object_bytes,
                server: Some(server),
            },
        );
        id
    }

    /// Bytes of one object of group `group` of layout `layout`.
    pub(crate) fn object_bytes(&self, layout: u32, group: u32) -> Result<u64> {
        self.layouts
            .get(&layout)
            .and_then(|l| l.object_bytes.get(group as usize).copied())
            .ok_or_else(|| {
                ClientError::Invalid(format!(
                    "no group {group} in layout {layout} of this client"
                ))
            })
    }

    /// The server's id of client layout `layout` in generation `generation`.
    pub(crate) fn server_layout(&self, layout: u32, generation: u64) -> Result<u32> {
        let l = self.layouts.get(&layout).ok_or_else(|| {
            ClientError::UnknownLayout(format!(
                "no KV layout with id {layout} in this client; register the layout first"
            ))
        })?;
        match l.server {
            Some((g, sid)) if g == generation => Ok(sid),
            _ => Err(ClientError::UnknownLayout(format!(
                "layout {layout} is not registered with the current server session"
            ))),
        }
    }

    /// Translates client-address layers into runs of server regions registered in
    /// generation `generation`: what a layout registration sends.
    pub(crate) fn layout_runs(
        &self,
        groups: &[Vec<LayerSpec>],
        generation: u64,
    ) -> Result<Vec<v1::LayoutGroup>> {
        let mut out = Vec::with_capacity(groups.len());
        for (g, layers) in groups.iter().enumerate() {
            let mut runs = Vec::with_capacity(layers.len());
            for (i, l) in layers.iter().enumerate() {
                let span = l
                    .num_blocks
                    .checked_sub(1)
                    .and_then(|n| n.checked_mul(l.block_stride))
                    .and_then(|s| s.checked_add(l.block_bytes))
                    .ok_or_else(|| ClientError::Invalid(format!("group {g} layer {i}: num_blocks must be > 0 and the span must fit in 64 bits")))?;
                let region = self
                    .regions
                    .values()
                    .find(|r| l.base_addr >= r.addr && l.base_addr.checked_add(span).is_some_and(|e| e <= r.addr + r.len))
                    .ok_or_else(|| {
                        ClientError::Unregistered(format!(
                            "group {g} layer {i}: {:#x}+{span} lies in no memory this client registered; register the KV cache tensor first",
                            l.base_addr
                        ))
                    })?;
                let (region_generation, server_region) = region.server.ok_or_else(|| {
                    ClientError::Unregistered(format!(
                        "group {g} layer {i}: its memory is not registered with the server"
                    ))
                })?;
                if region_generation != generation {
                    return Err(ClientError::Unregistered(
                        "memory registrations are from an earlier session".into(),
                    ));
                }
                let base_in_region = match &region.source {
                    // The server maps the memfd from the span's start.
                    Source::Host(_) | Source::Cuda => l.base_addr - region.addr,
                };
                runs.push(v1::LayoutRun {
                    region_id: server_region,
                    offset: base_in_region,
                    num_blocks: l.num_blocks,
                    block_stride: l.block_stride,
                    block_bytes: l.block_bytes,
                });
            }
            out.push(v1::LayoutGroup { runs });
        }
        Ok(out)
    }

    /// Registers every region, then every layout, again in generation `generation`, in the
    /// order of their client ids (a layout's runs name regions registered before it):
    /// `register_region` registers one region and `register_layout` one layout's groups (given
    /// these records, to translate them), each returning the server's id, recorded with
    /// `generation`. Stops at the first failure: what was not registered again keeps its old
    /// generation, which no call of the new session accepts.
    pub(crate) fn replay(
        &mut self,
        generation: u64,
        mut register_region: impl FnMut(&RegionRecord) -> Result<u64>,
        mut register_layout: impl FnMut(&Records, &[Vec<LayerSpec>]) -> Result<u32>,
    ) -> Result<()> {
        let ids: Vec<u64> = self.regions.keys().copied().collect();
        for id in ids {
            let r = self.regions.get_mut(&id).expect("listed");
            let sid = register_region(r)?;
            r.server = Some((generation, sid));
        }
        let lids: Vec<u32> = self.layouts.keys().copied().collect();
        for lid in lids {
            let groups = self.layouts[&lid].groups.clone();
            let sid = register_layout(self, &groups)?;
            self.layouts.get_mut(&lid).expect("listed").server = Some((generation, sid));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use umbp_core::ErrorKind;

    use super::*;

    fn layer(base_addr: u64, num_blocks: u64) -> LayerSpec {
        LayerSpec {
            base_addr,
            num_blocks,
            block_stride: 0x100,
            block_bytes: 0x80,
        }
    }

    /// Two regions of generation 1: client 0 at 0x10000 (server 7), client 1 at 0x20000
    /// (server 8), 0x1000 bytes each.
    fn two_regions() -> Records {
        let mut rec = Records::default();
        assert_eq!(rec.add_region(0x10000, 0x1000, Source::Cuda, (1, 7)), 0);
        assert_eq!(rec.add_region(0x20000, 0x1000, Source::Cuda, (1, 8)), 1);
        rec
    }

    #[test]
    fn a_range_overlapping_a_region_is_refused_and_neighbours_are_not() {
        let rec = two_regions();
        for (addr, len) in [
            (0x10000, 0x1000),
            (0x10fff, 1),
            (0xf000, 0x1001),
            (0x0, 0x30000),
        ] {
            let e = rec.check_free(addr, len).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Registration);
            assert!(e.to_string().contains("deregister that one first"), "{e}");
        }
        for (addr, len) in [(0xf000, 0x1000), (0x11000, 0xf000), (0x21000, 0x10)] {
            rec.check_free(addr, len).unwrap();
        }
    }

    #[test]
    fn layout_runs_name_the_server_regions_of_the_generation() {
        let rec = two_regions();
        let runs = rec
            .layout_runs(&[vec![layer(0x20100, 4)], vec![layer(0x10000, 16)]], 1)
            .unwrap();
        let got: Vec<Vec<(u64, u64, u64)>> = runs
            .iter()
            .map(|g| {
                g.runs
                    .iter()
                    .map(|r| (r.region_id, r.offset, r.num_blocks))
                    .collect()
            })
            .collect();
        assert_eq!(got, [vec![(8, 0x100, 4)], vec![(7, 0, 16)]]);
    }

    #[test]
    fn layout_runs_refuse_what_the_session_cannot_use() {
        let rec = two_regions();
        let err = |groups: Vec<Vec<LayerSpec>>, generation| {
            rec.layout_runs(&groups, generation).unwrap_err()
        };
        // Of an earlier session.
        let e = err(vec![vec![layer(0x10000, 1)]], 2);
        assert!(matches!(e, ClientError::Unregistered(_)), "{e}");
        assert!(e.to_string().contains("earlier session"), "{e}");
        // Running past its region (16 blocks of 0x100 from 0x10100 end at 0x11080).
        let e = err(vec![vec![layer(0x10100, 16)]], 1);
        assert!(matches!(e, ClientError::Unregistered(_)), "{e}");
        // In no region at all.
        let e = err(vec![vec![layer(0x30000, 1)]], 1);
        assert!(matches!(e, ClientError::Unregistered(_)), "{e}");
        // No blocks.
        let e = err(vec![vec![layer(0x10000, 0)]], 1);
        assert!(matches!(e, ClientError::Invalid(_)), "{e}");
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    }

    #[test]
    fn removing_a_region_drops_its_layouts_and_keeps_ids_unused() {
        let mut rec = two_regions();
        let in_first = rec.add_layout(vec![vec![layer(0x10000, 2)]], vec![0x80], (1, 50));
        let in_second = rec.add_layout(vec![vec![layer(0x20000, 2)]], vec![0x80], (1, 51));
        assert_eq!(rec.remove_region(0).unwrap(), Some((1, 7)));
        assert!(!rec.layouts.contains_key(&in_first));
        assert_eq!(rec.server_layout(in_second, 1).unwrap(), 51);
        let e = rec.server_layout(in_first, 1).unwrap_err();
        assert!(matches!(e, ClientError::UnknownLayout(_)), "{e}");
        let e = rec.remove_region(0).unwrap_err();
        assert!(matches!(e, ClientError::Unregistered(_)), "{e}");
        // Ids are not reused.
        assert_eq!(rec.add_region(0x10000, 0x1000, Source::Cuda, (1, 9)), 2);
        assert_eq!(rec.add_layout(vec![], vec![], (1, 52)), 2);
        let e = rec.object_bytes(in_second, 1).unwrap_err();
        assert!(matches!(e, ClientError::Invalid(_)), "{e}");
    }
}
