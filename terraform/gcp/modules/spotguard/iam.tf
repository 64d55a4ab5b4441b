# Agents: one service account per job. Its bucket bindings carry IAM conditions on the object
# name (read/write) and on the list prefix, so each VM reaches only <bucket>/<its job>/.
resource "google_service_account" "agent" {
  for_each = var.jobs

  project      = var.project_id
  account_id   = local.agent_account_id[each.key]
  display_name = "spotguard agent of job ${each.key}"
}

resource "google_storage_bucket_iam_member" "agent_objects" {
  for_each = var.jobs

  bucket = google_storage_bucket.images.name
  role   = "roles/storage.objectUser"
  member = "serviceAccount:${google_service_account.agent[each.key].email}"

  condition {
    title       = "own-job-objects"
    description = "Only objects under ${each.key}/"
    expression  = "resource.name.startsWith(\"projects/_/buckets/${local.bucket_name}/objects/${each.key}/\")"
  }
}

resource "google_storage_bucket_iam_member" "agent_list" {
  for_each = var.jobs

  bucket = google_storage_bucket.images.name
  role   = "roles/storage.objectViewer"
  member = "serviceAccount:${google_service_account.agent[each.key].email}"

  # objects.list is checked on the bucket: allow it only for the job's own prefix. Object reads
  # through this binding fail the condition (their resource type is Object).
  condition {
    title       = "own-job-listing"
    description = "List only under ${each.key}/"
    expression  = "resource.type == \"storage.googleapis.com/Bucket\" && api.getAttribute(\"storage.googleapis.com/objectListPrefix\", \"\").startsWith(\"${each.key}/\")"
  }
}

# The controller: creates and deletes the fleet's GPU VMs (its own custom roles, below), may act
# as the agent accounts only (to attach them to new VMs), reads images and deletes unreferenced
# chunks (gc).
resource "google_service_account" "controller" {
  project      = var.project_id
  account_id   = "${var.name}-controller"
  display_name = "spotguard controller"
}

# No predefined Compute role is narrow enough (roles/compute.instanceAdmin.v1 project-wide can
# create, change and delete every VM of the project, with any image). The controller gets two
# custom roles instead:
#   * controller_catalog, project-wide, reads only: the machine and GPU catalog of the zones,
#     the listing it finds a launch's VM by (labels filter), zone operations (a launch's or a
#     delete's progress);
#   * controller_launch, what instances.insert / get / delete need, under a condition on the
#     resource name (Compute Engine supports resource.type / resource.name conditions; labels
#     and images cannot be tested otherwise): only VMs and boot disks named as spotguard names
#     the VMs of this fleet's jobs (sg-<job>-<launch token>, providers/gcp.py instance_name),
#     only the module's boot image (or its family's project's images), only the given
#     subnetwork (or this project's), only the given network. Any other instance, disk, image,
#     network or subnetwork fails the condition.
locals {
  # sg-<job>- with the job lower-cased, other characters than a-z 0-9 - made "-", cut to 28
  # characters and "-" trimmed: as instance_name() names a job's VMs. Past 60 jobs the
  # condition would outgrow IAM's expression limit: then any name spotguard makes (sg-).
  controller_vm_prefixes = (
    length(var.jobs) > 60 ? ["sg-"] : sort(distinct([
      for job in keys(var.jobs) : "sg-${trim(substr(replace(lower(job), "/[^a-z0-9-]/", "-"), 0, 28), "-")}-"
    ]))
  )
  # the boot image as a resource name (projects/P/global/images/NAME); a family: that
  # project's images (the family's current image is one of them)
  controller_image_path = (
    startswith(var.image, "projects/") ? var.image : regex("projects/.*$", var.image)
  )
  controller_image_test = (
    strcontains(local.controller_image_path, "/images/family/")
    ? format("resource.name.startsWith(\"%s/images/\")", split("/images/family/", local.controller_image_path)[0])
    : format("resource.name == \"%s\"", local.controller_image_path)
  )
  controller_network_path = (
    length(split("/", var.network)) == 1
    ? "projects/${var.project_id}/global/networks/${var.network}"
    : startswith(var.network, "global/") ? "projects/${var.project_id}/${var.network}" : regex("projects/.*$", var.network)
  )
  controller_subnetwork_path = (
    var.subnetwork == null ? null
    : length(split("/", var.subnetwork)) == 1 ? "projects/${var.project_id}/regions/${var.region}/subnetworks/${var.subnetwork}"
    : startswith(var.subnetwork, "regions/") ? "projects/${var.project_id}/${var.subnetwork}" : regex("projects/.*$", var.subnetwork)
  )
  controller_subnetwork_test = (
    local.controller_subnetwork_path == null
    ? format("resource.name.startsWith(\"projects/%s/regions/\")", var.project_id)
    : format("resource.name == \"%s\"", local.controller_subnetwork_path)
  )
  # per kind of resource named after the VM: "its name starts with one of the prefixes"
  controller_vm_name_tests = {
    for kind in ["instances", "disks"] : kind => join(" || ", [
      for p in local.controller_vm_prefixes : format("resource.name.extract(\"/%s/{name}\").startsWith(\"%s\")", kind, p)
    ])
  }
  controller_launch_condition = join(" && ", [
    format(
      "(resource.type != \"compute.googleapis.com/Instance\" || (resource.name.startsWith(\"projects/%s/zones/\") && (%s)))",
      var.project_id, local.controller_vm_name_tests["instances"]
    ),
    format(
      "(resource.type != \"compute.googleapis.com/Disk\" || (resource.name.startsWith(\"projects/%s/zones/\") && (%s)))",
      var.project_id, local.controller_vm_name_tests["disks"]
    ),
    format("(resource.type != \"compute.googleapis.com/Image\" || %s)", local.controller_image_test),
    format("(resource.type != \"compute.googleapis.com/Network\" || resource.name == \"%s\")", local.controller_network_path),
    format("(resource.type != \"compute.googleapis.com/Subnetwork\" || %s)", local.controller_subnetwork_test),
  ])
}

resource "google_project_iam_custom_role" "controller_catalog" {
  project     = var.project_id
  role_id     = "${replace(var.name, "-", "_")}_controller_catalog"
  title       = "spotguard controller (${var.name}): catalog and state"
  description = "Machine and GPU types of the zones, the VM listing a launch is found by, zone operations."
  permissions = [
    "compute.acceleratorTypes.list",
    "compute.instances.list",
    "compute.machineTypes.list",
    "compute.zoneOperations.get",
  ]
}

resource "google_project_iam_custom_role" "controller_launch" {
  project     = var.project_id
  role_id     = "${replace(var.name, "-", "_")}_controller_launch"
  title       = "spotguard controller (${var.name}): launch and delete the jobs' VMs"
  description = "instances.insert/get/delete of the fleet's VMs; limited by the binding's condition."
  permissions = [
    "compute.disks.create",
    "compute.disks.setLabels",
    "compute.images.useReadOnly",
    "compute.instances.create",
    "compute.instances.delete",
    "compute.instances.get",
    "compute.instances.setLabels",
    "compute.instances.setMetadata",
    "compute.instances.setScheduling",
    "compute.instances.setServiceAccount",
    "compute.networks.use",
    "compute.subnetworks.use",
  ]
}

resource "google_project_iam_member" "controller_catalog" {
  project = var.project_id
  role    = google_project_iam_custom_role.controller_catalog.id
  member  = "serviceAccount:${google_service_account.controller.email}"
}

resource "google_project_iam_member" "controller_launch" {
  project = var.project_id
  role    = google_project_iam_custom_role.controller_launch.id
  member  = "serviceAccount:${google_service_account.controller.email}"

  condition {
    title       = "spotguard-fleet-vms"
    description = "Only the fleet's VMs and boot disks (by name), its image, network and subnetwork"
    expression  = local.controller_launch_condition
  }
}

resource "google_service_account_iam_member" "controller_acts_as_agent" {
  for_each = var.jobs

  service_account_id = google_service_account.agent[each.key].name
  role               = "roles/iam.serviceAccountUser"
  member             = "serviceAccount:${google_service_account.controller.email}"
}

# Images: read (list, get) and delete what gc collects, as on AWS (ListBucket, GetObject,
# DeleteObject). Not roles/storage.objectUser, which also creates and overwrites objects: the
# controller never writes an image.
resource "google_project_iam_custom_role" "controller_images" {
  project     = var.project_id
  role_id     = "${replace(var.name, "-", "_")}_controller_images"
  title       = "spotguard controller (${var.name}): read images, delete what gc collects"
  description = "List and read the images bucket's objects; delete them (gc). No create or update."
  permissions = [
    "storage.objects.delete",
    "storage.objects.get",
    "storage.objects.list",
  ]
}

resource "google_storage_bucket_iam_member" "controller_images" {
  bucket = google_storage_bucket.images.name
  role   = google_project_iam_custom_role.controller_images.id
  member = "serviceAccount:${google_service_account.controller.email}"
}
