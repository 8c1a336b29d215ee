"""A comparable snapshot of everything the memory schemas define, read from the catalog."""

from __future__ import annotations

import psycopg

SCHEMAS = ("memory", "memory_private")

QUERIES = {
    "schemas": """
        select n.nspname, coalesce(n.nspacl::text, ''), coalesce(obj_description(n.oid), '')
          from pg_namespace n where n.nspname = any(%(s)s) order by 1""",
    "columns": """
        select c.table_schema, c.table_name, c.column_name, c.data_type, c.is_nullable,
               coalesce(c.column_default, ''), coalesce(c.is_identity, ''), c.ordinal_position
          from information_schema.columns c where c.table_schema = any(%(s)s) order by 1, 2, 8""",
    "constraints": """
        select n.nspname, t.relname, con.conname, pg_get_constraintdef(con.oid)
          from pg_constraint con join pg_class t on t.oid = con.conrelid
          join pg_namespace n on n.oid = t.relnamespace
         where n.nspname = any(%(s)s) order by 1, 2, 3""",
    "indexes": """
        select schemaname, tablename, indexname, indexdef from pg_indexes
         where schemaname = any(%(s)s) order by 1, 2, 3""",
    "relations": """
        select n.nspname, c.relname, c.relkind, coalesce(c.relacl::text, ''),
               coalesce(obj_description(c.oid), ''),
               case when c.relkind = 'v' then pg_get_viewdef(c.oid) else '' end
          from pg_class c join pg_namespace n on n.oid = c.relnamespace
         where n.nspname = any(%(s)s) and c.relkind in ('r', 'v', 'm', 'S')
         order by 1, 2""",
    "functions": """
        select n.nspname, p.proname, pg_get_function_identity_arguments(p.oid),
               pg_get_functiondef(p.oid), coalesce(p.proacl::text, ''),
               coalesce(obj_description(p.oid), '')
          from pg_proc p join pg_namespace n on n.oid = p.pronamespace
         where n.nspname = any(%(s)s) order by 1, 2, 3""",
    "types": """
        select n.nspname, t.typname, t.typtype from pg_type t
          join pg_namespace n on n.oid = t.typnamespace
         where n.nspname = any(%(s)s) and t.typtype in ('e', 'd', 'c')
           and not exists (select 1 from pg_class c where c.reltype = t.oid)
         order by 1, 2""",
    "column_comments": """
        select n.nspname, c.relname, a.attname, col_description(c.oid, a.attnum)
          from pg_attribute a join pg_class c on c.oid = a.attrelid
          join pg_namespace n on n.oid = c.relnamespace
         where n.nspname = any(%(s)s) and a.attnum > 0 and col_description(c.oid, a.attnum) is not null
         order by 1, 2, 3""",
}


def snapshot(conn: psycopg.Connection) -> dict[str, list[tuple[object, ...]]]:
    return {name: conn.execute(sql, {"s": list(SCHEMAS)}).fetchall() for name, sql in QUERIES.items()}
