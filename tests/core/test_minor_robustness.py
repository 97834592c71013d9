"""``polyaccel kernels``: the table's columns line up whatever the length of an op's or a
backend's name (``linear_cross_entropy_grads`` used to push its row's columns right)."""

from __future__ import annotations

from polyaccel.core import cli


def _columns_start_at_the_same_places(lines: list[str], n_columns: int) -> None:
    header = lines[0]
    starts = [i for i in range(len(header)) if header[i] != " " and (i == 0 or header[i - 1] == " ")]
    assert len(starts) == n_columns, header
    for line in lines[1:]:
        for s in starts[1:]:
            assert line[s - 1] == " " and line[s] != " ", (line, s)  # each cell begins where its header does
    assert all(line == line.rstrip() for line in lines), "no trailing blanks"


def test_kernels_table_aligns_for_the_longest_op(capsys) -> None:
    assert cli.main(["kernels"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.split()[0] == "linear_cross_entropy_grads" for line in lines[1:])
    _columns_start_at_the_same_places(lines, len(lines[0].split()))


def test_table_columns_are_as_wide_as_their_widest_cell(capsys) -> None:
    cli._print_table(["op", "reference", "cuda"],
                     [["a_very_long_operation_name_indeed", "torch", "-"],
                      ["x", "torch", "a_long_kernel_backend_name"], ["y", "torch", "-"]])
    lines = capsys.readouterr().out.splitlines()
    _columns_start_at_the_same_places(lines, 3)
