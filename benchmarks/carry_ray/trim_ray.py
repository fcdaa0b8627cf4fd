"""Rewrite a Ray wheel without the members a Python-only cluster does not load.
Keeps zip external_attr (executable bits) and a consistent RECORD."""
import sys, zipfile, csv, io

DROP_PREFIXES = ("ray/jars/", "ray/rllib/", "ray/llm/", "ray/dashboard/client/")
# the dashboard head refuses to start without client/build and client/build/static
KEEP = {
    "ray/dashboard/client/build/index.html",
    "ray/dashboard/client/build/favicon.ico",
    "ray/dashboard/client/build/asset-manifest.json",
    "ray/dashboard/client/build/static/css/main.ec1426f1.css",
}

def keep(name):
    if name in KEEP:
        return True
    return not name.startswith(DROP_PREFIXES)

src, dst = sys.argv[1], sys.argv[2]
zin = zipfile.ZipFile(src)
record_name = [n for n in zin.namelist() if n.count("/") == 1 and n.endswith(".dist-info/RECORD")][0]
dropped = 0
with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
    for info in zin.infolist():
        if info.filename == record_name:
            continue
        if not keep(info.filename):
            dropped += 1
            continue
        zi = zipfile.ZipInfo(info.filename, date_time=info.date_time)
        zi.external_attr = info.external_attr
        zi.create_system = info.create_system
        zi.compress_type = zipfile.ZIP_DEFLATED
        zout.writestr(zi, zin.read(info), compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    rows = list(csv.reader(io.StringIO(zin.read(record_name).decode())))
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    for row in rows:
        if row and (row[0] == record_name or keep(row[0])):
            w.writerow(row)
    rinfo = zin.getinfo(record_name)
    zi = zipfile.ZipInfo(record_name, date_time=rinfo.date_time)
    zi.external_attr = rinfo.external_attr
    zi.create_system = rinfo.create_system
    zout.writestr(zi, out.getvalue(), compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
print("dropped", dropped, "members")
