"""A comparable snapshot of everything the memory schemas define, read from the catalog.

Two databases with equal snapshots have the same tables, columns (in the same order, whatever
columns an upgrade dropped on the way), constraints, indexes, extended statistics, triggers, views, functions, types,
comments, grants, default privileges, the memory roles and their memberships, and the same rows
in the reference tables (the tables without a ``workspace_id``: global configuration such as the
clock, the redaction patterns and the maintenance steps, i.e. behaviour stored as data). The
reference tables are found from the catalog, so a new one is covered without editing this file.
"""

from __future__ import annotations

import psycopg
from psycopg import sql

SCHEMAS = ("memory", "memory_private")

# The roles the schema grants to: every grantee of an ACL in the memory schemas but the owner.
ROLES = """
    select distinct pg_get_userbyid(a.grantee) as rolname
      from (select n.nspacl as acl, n.nspowner as owner from pg_namespace n
             where n.nspname = any(%(s)s)
            union all
            select p.proacl, p.proowner from pg_proc p
              join pg_namespace n on n.oid = p.pronamespace
             where n.nspname = any(%(s)s)
            union all
            select c.relacl, c.relowner from pg_class c
              join pg_namespace n on n.oid = c.relnamespace
             where n.nspname = any(%(s)s)) o
     cross join lateral aclexplode(o.acl) a
     where a.grantee <> 0 and a.grantee <> o.owner"""

QUERIES = {
    "schemas": """
        select n.nspname, coalesce(n.nspacl::text, ''), coalesce(obj_description(n.oid), '')
          from pg_namespace n where n.nspname = any(%(s)s) order by 1""",
    # The position among the columns that exist: an upgrade that dropped a column leaves a gap
    # in attnum that a fresh build does not have, and that gap is not a difference.
    "columns": """
        select c.table_schema, c.table_name, c.column_name, c.data_type, c.is_nullable,
               coalesce(c.column_default, ''), coalesce(c.is_identity, ''),
               coalesce(c.is_generated, ''), coalesce(c.generation_expression, ''),
               row_number() over (partition by c.table_schema, c.table_name
                                  order by c.ordinal_position)
          from information_schema.columns c where c.table_schema = any(%(s)s)
         order by 1, 2, 10""",
    # A column stored other than its type's default (set storage main/external/...).
    "column_storage": """
        select n.nspname, c.relname, a.attname, a.attstorage::text
          from pg_attribute a join pg_class c on c.oid = a.attrelid
          join pg_namespace n on n.oid = c.relnamespace
          join pg_type t on t.oid = a.atttypid
         where n.nspname = any(%(s)s) and c.relkind in ('r', 'p') and a.attnum > 0
           and not a.attisdropped and a.attstorage <> t.typstorage
         order by 1, 2, 3""",
    "column_grants": """
        select n.nspname, c.relname, a.attname, a.attacl::text
          from pg_attribute a join pg_class c on c.oid = a.attrelid
          join pg_namespace n on n.oid = c.relnamespace
         where n.nspname = any(%(s)s) and a.attacl is not null and not a.attisdropped
         order by 1, 2, 3""",
    "constraints": """
        select n.nspname, t.relname, con.conname, pg_get_constraintdef(con.oid),
               con.condeferrable, con.condeferred
          from pg_constraint con join pg_class t on t.oid = con.conrelid
          join pg_namespace n on n.oid = t.relnamespace
         where n.nspname = any(%(s)s) order by 1, 2, 3""",
    "indexes": """
        select schemaname, tablename, indexname, indexdef from pg_indexes
         where schemaname = any(%(s)s) order by 1, 2, 3""",
    "statistics": """
        select n.nspname, s.stxname, pg_get_statisticsobjdef(s.oid),
               coalesce(obj_description(s.oid, 'pg_statistic_ext'), '')
          from pg_statistic_ext s join pg_namespace n on n.oid = s.stxnamespace
         where n.nspname = any(%(s)s) order by 1, 2""",
    "triggers": """
        select n.nspname, c.relname, t.tgname, pg_get_triggerdef(t.oid), t.tgenabled::text,
               coalesce(obj_description(t.oid, 'pg_trigger'), '')
          from pg_trigger t join pg_class c on c.oid = t.tgrelid
          join pg_namespace n on n.oid = c.relnamespace
         where n.nspname = any(%(s)s) and not t.tgisinternal
         order by 1, 2, 3""",
    "policies": """
        select n.nspname, c.relname, p.polname, p.polcmd::text, p.polpermissive,
               coalesce(pg_get_expr(p.polqual, p.polrelid), ''),
               coalesce(pg_get_expr(p.polwithcheck, p.polrelid), ''),
               array(select pg_get_userbyid(r) from unnest(p.polroles) r order by 1)::text
          from pg_policy p join pg_class c on c.oid = p.polrelid
          join pg_namespace n on n.oid = c.relnamespace
         where n.nspname = any(%(s)s) order by 1, 2, 3""",
    "relations": """
        select n.nspname, c.relname, c.relkind, coalesce(c.relacl::text, ''),
               coalesce(obj_description(c.oid), ''),
               case when c.relkind = 'v' then pg_get_viewdef(c.oid) else '' end,
               c.relrowsecurity, c.relforcerowsecurity, coalesce(c.reloptions::text, '')
          from pg_class c join pg_namespace n on n.oid = c.relnamespace
         where n.nspname = any(%(s)s) and c.relkind in ('r', 'v', 'm', 'S', 'p')
         order by 1, 2""",
    "functions": """
        select n.nspname, p.proname, pg_get_function_identity_arguments(p.oid),
               pg_get_functiondef(p.oid), coalesce(p.proacl::text, ''),
               coalesce(obj_description(p.oid), '')
          from pg_proc p join pg_namespace n on n.oid = p.pronamespace
         where n.nspname = any(%(s)s) order by 1, 2, 3""",
    "types": """
        select n.nspname, t.typname, t.typtype,
               coalesce(array(select e.enumlabel from pg_enum e where e.enumtypid = t.oid
                               order by e.enumsortorder)::text, '')
          from pg_type t
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
    "default_privileges": f"""
        select pg_get_userbyid(d.defaclrole), coalesce(n.nspname, ''), d.defaclobjtype::text,
               d.defaclacl::text
          from pg_default_acl d left join pg_namespace n on n.oid = d.defaclnamespace
         where n.nspname = any(%(s)s)
            or (d.defaclnamespace = 0 and pg_get_userbyid(d.defaclrole) in ({ROLES}))
         order by 1, 2, 3""",
    "roles": f"""
        select r.rolname, r.rolcanlogin, r.rolinherit, r.rolsuper, r.rolcreaterole,
               r.rolcreatedb, r.rolreplication, r.rolbypassrls, r.rolconnlimit
          from pg_roles r where r.rolname in ({ROLES}) order by 1""",
    # Memberships among the schema's roles (login roles that deployments or tests grant them
    # to are not the schema's business).
    "role_memberships": f"""
        select pg_get_userbyid(m.roleid), pg_get_userbyid(m.member), m.admin_option
          from pg_auth_members m
         where pg_get_userbyid(m.roleid) in ({ROLES})
           and pg_get_userbyid(m.member) in ({ROLES})
         order by 1, 2""",
}

REFERENCE_TABLES = """
    select n.nspname, c.relname from pg_class c join pg_namespace n on n.oid = c.relnamespace
     where n.nspname = any(%(s)s) and c.relkind in ('r', 'p')
       and not exists (select 1 from pg_attribute a where a.attrelid = c.oid
                        and a.attname = 'workspace_id' and not a.attisdropped)
     order by 1, 2"""


def reference_tables(conn: psycopg.Connection) -> list[tuple[str, str]]:
    """The tables that hold no tenant's data (no ``workspace_id`` column)."""
    return [(s, t) for s, t in conn.execute(REFERENCE_TABLES, {"s": list(SCHEMAS)}).fetchall()]


def reference_rows(conn: psycopg.Connection) -> list[tuple[object, ...]]:
    """Every row of every reference table, as (schema, table, row as JSON text), sorted."""
    rows: list[tuple[object, ...]] = []
    for schema_name, table in reference_tables(conn):
        query = sql.SQL("select to_jsonb(t)::text from {}.{} t order by 1").format(
            sql.Identifier(schema_name), sql.Identifier(table))
        rows += [(schema_name, table, r[0]) for r in conn.execute(query).fetchall()]
    return rows


def snapshot(conn: psycopg.Connection) -> dict[str, list[tuple[object, ...]]]:
    snap = {name: conn.execute(q, {"s": list(SCHEMAS)}).fetchall()
            for name, q in QUERIES.items()}
    snap["reference_rows"] = reference_rows(conn)
    return snap
