//! Registering memory (host memory shared through a memfd, CUDA memory by IPC handle or
//! VMM descriptors) and KV layouts with the server, keeping records to register them again.

pub(crate) mod records;

use std::os::fd::{AsFd, BorrowedFd};

use umbp_core::LayerSpec;
use umbp_cuda_driver::DeviceExport;
use umbp_proto::v1;

use self::records::{Records, Source};
use crate::attach::state::Attachment;
use crate::client::StandaloneClient;
use crate::error::{ClientError, Result};
use crate::fdsend;
use crate::host_share::{self, SharedHostMemory};

/// A registered layout: the client's id and the bytes of one object per group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayoutInfo {
    /// The client's id of the layout (stable across re-attaches).
    pub id: u32,
    /// Bytes of one object of each group.
    pub object_bytes: Vec<u64>,
}

impl StandaloneClient {
    /// Registers one region with the server in attachment `a`; returns the server's id.
    pub(crate) fn register_region_on(
        &self,
        a: &Attachment,
        addr: u64,
        len: u64,
        source: &Source,
    ) -> Result<u64> {
        let t = self.inner.opts.control_timeout;
        let sid = a.session_id;
        match source {
            Source::Host(shm) => {
                // Every page allocated, and charged to this process, before the server maps
                // it (the server refuses memory with holes: its copies would allocate them).
                host_share::populate(shm.span_addr(), shm.span_len())?;
                let ticket = self.send_fds(a, &[shm.fd()])?[0];
                let length = shm.span_len();
                let r = self.call("register_host_memory", t, |mut g| async move {
                    g.register_host_memory(v1::RegisterHostMemoryRequest {
                        session_id: sid,
                        ticket,
                        length,
                    })
                    .await
                })?;
                Ok(r.region_id)
            }
            Source::Cuda => {
                let export = umbp_cuda_driver::export_device_range(addr, len)?;
                let device = Some(v1::CudaDevice {
                    uuid: export.device_uuid().to_vec(),
                });
                let r = match export {
                    DeviceExport::Legacy {
                        handle,
                        allocation_bytes,
                        offset,
                        length,
                        ..
                    } => self.call("register_cuda_memory", t, |mut g| async move {
                        g.register_cuda_ipc(v1::RegisterCudaIpcRequest {
                            session_id: sid,
                            device,
                            handle: handle.to_vec(),
                            allocation_bytes,
                            offset,
                            length,
                        })
                        .await
                    })?,
                    DeviceExport::Vmm {
                        chunks,
                        offset,
                        length,
                        ..
                    } => {
                        let fds: Vec<BorrowedFd<'_>> =
                            chunks.iter().map(|c| c.fd.as_fd()).collect();
                        let tickets = self.send_fds(a, &fds)?;
                        let chunks: Vec<v1::VmmChunk> = chunks
                            .iter()
                            .zip(tickets)
                            .map(|(c, ticket)| v1::VmmChunk {
                                ticket,
                                offset: c.offset,
                                size: c.size,
                            })
                            .collect();
                        self.call("register_cuda_memory", t, |mut g| async move {
                            g.register_cuda_vmm(v1::RegisterCudaVmmRequest {
                                session_id: sid,
                                device,
                                chunks,
                                offset,
                                length,
                            })
                            .await
                        })?
                    }
                };
                Ok(r.region_id)
            }
        }
    }

    pub(crate) fn send_fds(&self, a: &Attachment, fds: &[BorrowedFd<'_>]) -> Result<Vec<u64>> {
        self.check()?;
        fdsend::send_fds(&a.fd_socket, a.session_id, &a.secret, fds).inspect_err(|e| {
            if matches!(e, ClientError::Io { .. } | ClientError::Disconnected { .. }) {
                self.lost();
            }
        })
    }

    /// Translates client-address layers into region offsets of attachment `a` and registers
    /// them; returns the server's layout id and object bytes.
    pub(crate) fn register_layout_on(
        &self,
        a: &Attachment,
        rec: &Records,
        groups: &[Vec<LayerSpec>],
    ) -> Result<(u32, Vec<u64>)> {
        let out = rec.layout_runs(groups, a.generation)?;
        let sid = a.session_id;
        let r = self.call(
            "register_layout",
            self.inner.opts.control_timeout,
            |mut g| async move {
                g.register_layout(v1::RegisterLayoutRequest {
                    session_id: sid,
                    groups: out,
                })
                .await
            },
        )?;
        Ok((r.layout_id, r.object_bytes))
    }

    /// Shares host memory `[addr, addr + len)` of this process with the server (its pages are
    /// moved into a sealed memfd at the same addresses, see [`host_share::share_host_range`])
    /// and registers it. Returns the client's region id.
    ///
    /// # Safety
    /// As [`host_share::share_host_range`]: no other thread writes the pages of the range
    /// during the call, and the memory stays allocated while registered.
    pub unsafe fn register_host_memory(&self, addr: u64, len: u64) -> Result<u64> {
        self.check()?;
        // Before the pages move: a range registered already is refused untouched.
        self.inner.records.lock().check_free(addr, len)?;
        // SAFETY: forwarded contract.
        let shm = unsafe { host_share::share_host_range(addr, len) }?;
        self.add_region(shm.span_addr(), shm.span_len(), Source::Host(shm))
    }

    /// Registers memory that is already shared ([`host_share::alloc_shared_host`]).
    pub fn register_shared_host(&self, shm: SharedHostMemory) -> Result<u64> {
        self.check()?;
        self.add_region(shm.span_addr(), shm.span_len(), Source::Host(shm))
    }

    /// Registers CUDA memory `[addr, addr + len)` of this process (a KV cache tensor) by IPC
    /// handle, or by exported descriptors for virtual-memory allocations. Returns the
    /// client's region id.
    ///
    /// # Safety
    /// The memory stays allocated while registered (the server writes it on loads).
    pub unsafe fn register_cuda_memory(&self, addr: u64, len: u64) -> Result<u64> {
        self.check()?;
        self.inner.records.lock().check_free(addr, len)?;
        self.add_region(addr, len, Source::Cuda)
    }

    fn add_region(&self, addr: u64, len: u64, source: Source) -> Result<u64> {
        self.inner.records.lock().check_free(addr, len)?;
        let a = self.attachment()?;
        let sid = self.register_region_on(&a, addr, len, &source)?;
        let mut rec = self.inner.records.lock();
        if let Err(e) = rec.check_free(addr, len) {
            // Another thread registered an overlapping range meanwhile: this one goes.
            drop(rec);
            let _ = self.deregister_on_server(&a, sid);
            return Err(e);
        }
        Ok(rec.add_region(addr, len, source, (a.generation, sid)))
    }

    fn deregister_on_server(&self, a: &Attachment, sid: u64) -> Result<()> {
        let session_id = a.session_id;
        self.call(
            "deregister_memory",
            self.inner.opts.control_timeout,
            |mut g| async move {
                g.deregister_memory(v1::DeregisterMemoryRequest {
                    session_id,
                    region_id: sid,
                })
                .await
            },
        )?;
        Ok(())
    }

    /// Deregisters a region; layouts in it are dropped with it.
    pub fn deregister_memory(&self, id: u64) -> Result<()> {
        self.check()?;
        let server = self.inner.records.lock().remove_region(id)?;
        let a = self.inner.attach.current();
        if let (Some(a), Some((generation, sid))) = (a, server) {
            if generation == a.generation {
                self.deregister_on_server(&a, sid)?;
            }
        }
        Ok(())
    }

    /// Registers a layout given in this process's addresses (each run inside a registered
    /// region). Returns the client's layout id and each group's object size.
    pub fn register_layout(&self, groups: Vec<Vec<LayerSpec>>) -> Result<LayoutInfo> {
        let a = self.attachment()?;
        let mut rec = self.inner.records.lock();
        let (sid, object_bytes) = self.register_layout_on(&a, &rec, &groups)?;
        let id = rec.add_layout(groups, object_bytes.clone(), (a.generation, sid));
        Ok(LayoutInfo { id, object_bytes })
    }

    /// Bytes of one object of group `group` of layout `layout`.
    pub fn object_bytes(&self, layout: u32, group: u32) -> Result<u64> {
        self.inner.records.lock().object_bytes(layout, group)
    }

    /// The server's layout id of client layout `layout`, attaching again first if needed.
    pub(crate) fn server_layout(&self, layout: u32) -> Result<(Attachment, u32)> {
        let a = self.attachment()?;
        let sid = self
            .inner
            .records
            .lock()
            .server_layout(layout, a.generation)?;
        Ok((a, sid))
    }
}
