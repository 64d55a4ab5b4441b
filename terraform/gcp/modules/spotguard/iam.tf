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

# The controller: creates and deletes the GPU VMs, may act as the agent accounts only (to attach
# them to new VMs), reads images and deletes unreferenced chunks (gc).
resource "google_service_account" "controller" {
  project      = var.project_id
  account_id   = "${var.name}-controller"
  display_name = "spotguard controller"
}

# Compute Engine IAM conditions cannot test instance labels, so this project-level role is the
# narrowest predefined one that can create, delete and describe VMs.
resource "google_project_iam_member" "controller_compute" {
  project = var.project_id
  role    = "roles/compute.instanceAdmin.v1"
  member  = "serviceAccount:${google_service_account.controller.email}"
}

resource "google_service_account_iam_member" "controller_acts_as_agent" {
  for_each = var.jobs

  service_account_id = google_service_account.agent[each.key].name
  role               = "roles/iam.serviceAccountUser"
  member             = "serviceAccount:${google_service_account.controller.email}"
}

resource "google_storage_bucket_iam_member" "controller_images" {
  bucket = google_storage_bucket.images.name
  role   = "roles/storage.objectUser"
  member = "serviceAccount:${google_service_account.controller.email}"
}
