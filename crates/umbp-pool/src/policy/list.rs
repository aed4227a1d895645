//! Intrusive doubly linked lists over entry ids: the links live in one vector indexed by id,
//! so an id can be in at most one of the lists that share the vector.

pub(crate) const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
pub(crate) struct Link {
    pub prev: u32,
    pub next: u32,
}

impl Default for Link {
    fn default() -> Self {
        Link {
            prev: NIL,
            next: NIL,
        }
    }
}

/// One list's ends; the links are the caller's.
#[derive(Debug, Clone, Copy)]
pub(crate) struct List {
    pub head: u32,
    pub tail: u32,
    pub len: usize,
}

impl Default for List {
    fn default() -> Self {
        List {
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }
}

impl List {
    pub fn push_tail<L: AsMut<Link>>(&mut self, links: &mut [L], idx: u32) {
        let l = links[idx as usize].as_mut();
        l.prev = self.tail;
        l.next = NIL;
        if self.tail == NIL {
            self.head = idx;
        } else {
            links[self.tail as usize].as_mut().next = idx;
        }
        self.tail = idx;
        self.len += 1;
    }

    pub fn unlink<L: AsMut<Link>>(&mut self, links: &mut [L], idx: u32) {
        let Link { prev, next } = *links[idx as usize].as_mut();
        if prev == NIL {
            self.head = next;
        } else {
            links[prev as usize].as_mut().next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            links[next as usize].as_mut().prev = prev;
        }
        self.len -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl AsMut<Link> for Link {
        fn as_mut(&mut self) -> &mut Link {
            self
        }
    }

    fn collect(list: &List, links: &[Link]) -> Vec<u32> {
        let mut out = Vec::new();
        let mut i = list.head;
        while i != NIL {
            out.push(i);
            i = links[i as usize].next;
        }
        out
    }

    #[test]
    fn push_and_unlink_keep_order() {
        let mut links = vec![Link::default(); 5];
        let mut l = List::default();
        for i in 0..5 {
            l.push_tail(&mut links, i);
        }
        l.unlink(&mut links, 0);
        l.unlink(&mut links, 2);
        l.unlink(&mut links, 4);
        assert_eq!(collect(&l, &links), vec![1, 3]);
        assert_eq!(l.len, 2);
        l.push_tail(&mut links, 2);
        assert_eq!(collect(&l, &links), vec![1, 3, 2]);
        assert_eq!(l.tail, 2);
    }
}
