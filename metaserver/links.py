"""Prefix links of the page directory (``PrefixLinks``, a mixin of ``metaserver.directory.Directory``): a READY
entry naming a parent is linked to that parent's Entry (and counted among its ``kids``) exactly while the parent is
READY, else it waits among the namespace's orphans to be adopted when the parent arrives. prefix-lru reads these
links (a page whose children are cached is worth more than a leaf). Costs: O(1) per link or unlink, O(children)
when a parent arrives or goes.
"""

from __future__ import annotations

from metaserver.entry import READY, Entry


class PrefixLinks:
    def _link_ready(self, e: Entry) -> None:
        """``e`` just became READY (and is in ``ready``): link it to its parent if that is READY, else file it as an
        orphan; then adopt the orphans that name it."""
        up = e.up
        if up is not None:
            if type(up) is bytes:
                r = self.ready.get(e.ns)
                p = r.get(up) if r is not None else None
            else:
                p = up
            if p is not None and p is not e and p.state == READY:
                self._link(e, p)
            else:
                if type(up) is not bytes:
                    e.up = up.key
                self._add_orphan(e)
        o = self.orphans.get(e.ns)
        if o:
            waiting = o.pop(e.key, None)
            if waiting is not None:
                self._adopt(e, o, waiting)

    def _adopt(self, e: Entry, o: dict, waiting) -> None:
        """``e`` just became READY: link the orphans ``waiting`` for it (popped from ``o``, its namespace's
        orphans)."""
        if not o:
            del self.orphans[e.ns]
        for c in (waiting if type(waiting) is set else (waiting,)):
            if c is e:  # names itself: stays an orphan
                self._add_orphan(e)
            else:
                self._link(c, e)
                self.policy.children_changed(c)  # no longer an orphan

    def _link(self, child: Entry, parent: Entry) -> None:
        child.up = parent
        k = parent.kids
        if k is None:
            parent.kids = child
            if parent.pins == 0:
                self.policy.children_changed(parent)
        elif type(k) is set:
            k.add(child)
        else:
            parent.kids = {k, child}

    def _drop_kid(self, parent: Entry, child: Entry) -> None:
        k = parent.kids
        if k is child:
            parent.kids = None
        elif type(k) is set:
            k.discard(child)
            if len(k) == 1:
                parent.kids = next(iter(k))
            return
        else:
            return
        if parent.state == READY and parent.pins == 0:
            self.policy.children_changed(parent)

    def _add_orphan(self, c: Entry) -> None:
        o = self.orphans.get(c.ns)
        if o is None:
            o = self.orphans[c.ns] = {}
        k = c.up
        cur = o.get(k)
        if cur is None:
            o[k] = c
        elif type(cur) is set:
            cur.add(c)
        elif cur is not c:
            o[k] = {cur, c}

    def _forget_orphan(self, c: Entry) -> None:
        o = self.orphans.get(c.ns)
        if o is None:
            return
        k = c.up
        cur = o.get(k)
        if cur is c:
            del o[k]
            if not o:
                del self.orphans[c.ns]
        elif type(cur) is set:
            cur.discard(c)
            if len(cur) == 1:
                o[k] = next(iter(cur))
