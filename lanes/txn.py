"""The journaled changes of a lane root, and their repair.

install:  begin -> copied (into instances/.tmp-<id>) -> verified (every file against the
          manifest; then sealed) -> renamed (to instances/<id>) -> unit -> switched -> done
rollback: begin -> switched -> done

Each step is a durable journal line written after the step's effect. `current` only ever
changes by one rename to a complete, verified instance, so it always names one. `recover`
(run first by every lane command, under the root's lock) finishes an unfinished transaction
when its instance is complete and verifies, and otherwise rolls it back: the copy is removed
and the pointers are put back as the transaction found them ("aborted")."""
from __future__ import annotations

from lanes import unit
from lanes.instance import LaneError, Source, force_rmtree, listing, publish, verify
from lanes.root import LaneRoot

INSTALL_STEPS = ("begin", "copying", "copied", "verified", "renamed", "unit", "switched")
ROLLBACK_STEPS = ("begin", "switched")


def check_instance(root: LaneRoot, iid: str) -> Source:
    """The installed instance `iid`, verified against its manifest (LaneError if not)."""
    path = root.instance(iid)
    if not path.is_dir():
        raise LaneError(f"instance {iid} is not installed under {root.instances}")
    src = Source.from_instance(path)
    problems = verify(path, src)
    if problems:
        raise LaneError(f"instance {iid[:16]} under {root.instances} was tampered with; it "
                        f"differs from its manifest:" + listing(problems) +
                        "\ninstall it again from a pack (./ninfer lane install --from DIR), "
                        "or roll back")
    return src


def install(root: LaneRoot, src: Source, lane: str, *, enable: bool = False,
            before_switch=None) -> list[str]:
    """Install `src` as the current instance serving `lane`; returns notes for the operator.
    `before_switch()` runs once the instance and unit are in place (e.g. a managed stop)."""
    j = root.journal
    cur, prev = root.pointer("current"), root.pointer("previous")
    txn = j.begin("install", id=src.id, lane=lane, **{"from": cur, "prev": prev},
                  enable=enable)
    try:
        publish(src, root.instances, fault=j.fault, on_step=lambda s: j.step(txn, s))
    except BaseException as e:
        _abort(root, txn, src.id, cur, prev, reason=str(e)[:200])
        raise
    return _finish_install(root, txn, src.id, lane, cur, prev, enable, before_switch)


def _finish_install(root, txn, iid, lane, cur, prev, enable, before_switch=None,
                    repaired: bool = False) -> list[str]:
    j = root.journal
    try:
        path, note = unit.write(root, lane, root.instance(iid))
        root.set_lane(lane)
        notes = [f"unit {path} ({note})"]
        if enable:
            notes += unit.enable(path) or [f"enabled {path.name} in {unit.USER_UNIT_DIR}"]
        j.step(txn, "unit")
        if before_switch is not None:
            before_switch()
    except BaseException as e:
        _abort(root, txn, iid, cur, prev, reason=str(e)[:200])
        raise
    root.set_pointers(current=iid, previous=cur if cur not in (None, iid) else prev)
    j.step(txn, "switched")
    j.step(txn, "done", **({"repaired": True} if repaired else {}))
    return notes


def rollback(root: LaneRoot, before_switch=None) -> tuple[str, str]:
    """Switch current and previous; returns (the new current, the new previous)."""
    cur, prev = root.pointer("current"), root.pointer("previous")
    if prev is None:
        raise LaneError(f"nothing to roll back to: {root.path} has no previous instance")
    check_instance(root, prev)
    j = root.journal
    txn = j.begin("rollback", **{"from": cur, "to": prev})
    if before_switch is not None:
        before_switch()
    root.set_pointers(current=prev, previous=cur)
    j.step(txn, "switched")
    j.step(txn, "done")
    return prev, cur


def _abort(root: LaneRoot, txn: int, iid: str, cur, prev, reason: str,
           repaired: bool = False) -> None:
    """Undo an install: no copy left, the pointers as the transaction found them (a complete
    instance already renamed into place stays installed, not current)."""
    force_rmtree(root.instances / f".tmp-{iid}")
    root.set_pointers(current=cur, previous=prev)
    root.journal.step(txn, "aborted", reason=reason, **({"repaired": True} if repaired else {}))


def recover(root: LaneRoot) -> list[str]:
    """Finish or roll back the root's unfinished transaction, then remove leftovers; what was
    done, for the operator (empty: nothing was unfinished)."""
    recs = root.journal.pending()
    done = []
    if recs:
        begin, last = recs[0], recs[-1]["step"]
        txn, op = begin["txn"], begin["op"]
        target = begin["id"] if op == "install" else begin["to"]
        try:
            check_instance(root, target)
            ok = None
        except LaneError as e:
            ok = str(e).splitlines()[0]
        if op == "install" and ok is None:
            _finish_install(root, txn, target, begin["lane"], begin["from"], begin["prev"],
                            begin.get("enable", False), repaired=True)
            done.append(f"finished the install of {target[:16]} interrupted after "
                        f"'{last}': it is current")
        elif op == "install":
            _abort(root, txn, target, begin["from"], begin["prev"], reason=f"interrupted after "
                   f"'{last}'; {ok}", repaired=True)
            done.append(f"rolled back the install of {target[:16]} interrupted after "
                        f"'{last}': current is {_short(begin['from'])} again")
        elif ok is None:
            root.set_pointers(current=target, previous=begin["from"])
            root.journal.step(txn, "switched")
            root.journal.step(txn, "done", repaired=True)
            done.append(f"finished the rollback to {target[:16]} interrupted after '{last}'")
        else:
            root.set_pointers(current=begin["from"], previous=target)
            root.journal.step(txn, "aborted", reason=ok, repaired=True)
            done.append(f"undid the rollback interrupted after '{last}': {ok}")
    done += [f"removed the leftover {p}" for p in root.sweep()]
    return done


def _short(iid: str | None) -> str:
    return iid[:16] if iid else "(none)"
